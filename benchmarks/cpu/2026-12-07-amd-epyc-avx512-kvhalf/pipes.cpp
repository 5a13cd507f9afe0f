// Which vector operations share the AVX-512 VNNI unit on this CPU: cycles for 12 independent
// VNNI multiply-adds (zmm) per loop iteration, alone and beside 4 or 8 other independent ops.
// Build and run: g++ -O3 -o pipes pipes.cpp && ./pipes
// (The cycle count is calibrated by a chain of dependent integer adds, one a cycle.)
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define VNNI(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define TWELVE VNNI(0) VNNI(1) VNNI(2) VNNI(3) VNNI(4) VNNI(5) VNNI(6) VNNI(7) VNNI(8) VNNI(9) VNNI(10) VNNI(11)
#define LOOP(NAME, OTHER)                                                                                      \
  __attribute__((target("avx512f,avx512bw,avx512vnni,fma"), noinline)) double NAME(int iters) {             \
    __m512i a0 = _mm512_set1_epi32(1), a1 = _mm512_set1_epi32(2), a2 = _mm512_set1_epi32(3),                  \
            a3 = _mm512_set1_epi32(4), a4 = _mm512_set1_epi32(5), a5 = _mm512_set1_epi32(6),                   \
            a6 = _mm512_set1_epi32(7), a7 = _mm512_set1_epi32(8), a8 = _mm512_set1_epi32(9),                   \
            a9 = _mm512_set1_epi32(10), a10 = _mm512_set1_epi32(11), a11 = _mm512_set1_epi32(12);             \
    const __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x02020202);                      \
    const __m512 c1 = _mm512_set1_ps(1.0001f), c2 = _mm512_set1_ps(0.5f);                                     \
    __m512 f0 = _mm512_set1_ps(1.f), f1 = _mm512_set1_ps(2.f), f2 = _mm512_set1_ps(3.f),                      \
           f3 = _mm512_set1_ps(4.f), f4 = _mm512_set1_ps(5.f), f5 = _mm512_set1_ps(6.f),                      \
           f6 = _mm512_set1_ps(7.f), f7 = _mm512_set1_ps(8.f);                                                \
    __m512i g0 = _mm512_set1_epi32(3), g1 = _mm512_set1_epi32(5), g2 = _mm512_set1_epi32(7),                  \
            g3 = _mm512_set1_epi32(9);                                                                         \
    const auto t0 = std::chrono::steady_clock::now();                                                         \
    for (int it = 0; it < iters; ++it) { TWELVE OTHER }                                                      \
    const auto t1 = std::chrono::steady_clock::now();                                                         \
    volatile int keep = _mm512_reduce_add_epi32(_mm512_add_epi32(                                             \
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),                \
                         _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7))),              \
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)),              \
                         _mm512_add_epi32(_mm512_add_epi32(g0, g1), _mm512_add_epi32(g2, g3)))));             \
    volatile float keepf = _mm512_reduce_add_ps(_mm512_add_ps(                                                \
        _mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3)),                                          \
        _mm512_add_ps(_mm512_add_ps(f4, f5), _mm512_add_ps(f6, f7))));                                        \
    (void)keep; (void)keepf; (void)c2;                                                                        \
    return std::chrono::duration<double>(t1 - t0).count();                                                    \
  }
#define F8(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, c1, c2);
#define MUL(i) f##i = _mm512_mul_ps(f##i, c1);
#define ADD(i) f##i = _mm512_add_ps(f##i, c1);
#define CVT(i) f##i = _mm512_cvtepi32_ps(_mm512_castps_si512(f##i));
#define I4(OP) OP(0) OP(1) OP(2) OP(3)
#define AND(n) g##n = _mm512_and_si512(g##n, x);
#define SRL(n) g##n = _mm512_srli_epi16(g##n, 1);
LOOP(alone, )
LOOP(fma8, F8(FMA))
LOOP(mul8, F8(MUL))
LOOP(add8, F8(ADD))
LOOP(cvt8, F8(CVT))
LOOP(and4, I4(AND))
LOOP(shift4, I4(SRL))

__attribute__((noinline)) double adds(long n) {  // n dependent adds: n cycles
  long v = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; i += 4) asm volatile("add %1, %0\n add %1, %0\n add %1, %0\n add %1, %0" : "+r"(v) : "r"(i));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  const int n = 20000000;
  const double ghz = 1.0 / adds(1000000000L);
  std::printf("clock %.2f GHz\n", ghz);
  const struct { const char* name; double (*run)(int); } loops[] = {
      {"12 VNNI alone", alone}, {"+ 8 FMA", fma8}, {"+ 8 mul", mul8}, {"+ 8 add", add8},
      {"+ 8 int->float", cvt8}, {"+ 4 and", and4}, {"+ 4 shift", shift4}};
  for (const auto& l : loops) std::printf("%-16s %6.2f cycles an iteration\n", l.name, l.run(n) * ghz * 1e9 / n);
}
