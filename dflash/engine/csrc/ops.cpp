// The operators torch.ops.dflash_lowbit.* (engine/native.py builds and loads this library).
#include <torch/library.h>

#include "lowbit.h"

// OpenMP 5.0's pause call: libgomp has it since GCC 9 (whose _OPENMP still says 4.5), LLVM's libomp too
#if defined(_OPENMP) && (defined(__clang__) || __GNUC__ >= 9)
#include <omp.h>
#define DFLASH_OMP_PAUSE 1
#endif

namespace dflash_lowbit {
namespace {
// "avx512" (AVX-512 VNNI), "avx2" or "portable": the code the kernels run on this CPU
std::string simd() { return isa() == Isa::avx512 ? "avx512" : isa() == Isa::avx2 ? "avx2" : "portable"; }

// Ends the OpenMP threads the calling thread's parallel regions started (they come back when it
// runs one again). True when there were OpenMP threads to end.
bool release_threads() {
#ifdef DFLASH_OMP_PAUSE
  return omp_pause_resource_all(omp_pause_soft) == 0;
#else
  return false;
#endif
}
}  // namespace
}  // namespace dflash_lowbit

using namespace dflash_lowbit;

TORCH_LIBRARY(dflash_lowbit, lib) {
  lib.def("qmm(Tensor x, Tensor u, Tensor d, Tensor m, int n, int bits) -> Tensor");
  lib.def("quantize(Tensor x) -> Tensor[]");
  lib.def("half(Tensor x) -> Tensor");
  lib.def("attend(Tensor q, Tensor k, Tensor v, int past, Tensor? mask, float scale) -> Tensor");
  lib.def("llama_forward(Tensor x, Tensor[] weights, int[] bits, Tensor norms, float eps, Tensor cos, Tensor sin, "
          "Tensor[] k_all, Tensor[] v_all, int[] pasts, int[] counts, Tensor[] masks, float scale, int heads, "
          "int[] keep) -> Tensor[]");
  lib.def("simd() -> str", simd);
  lib.def("release_threads() -> bool", release_threads);
}

TORCH_LIBRARY_IMPL(dflash_lowbit, CPU, lib) {
  lib.impl("qmm", qmm);
  lib.impl("quantize", quantize);
  lib.impl("half", half);
  lib.impl("attend", attend);
  lib.impl("llama_forward", llama_forward);
}
