// One Llama decoder layer over the new rows of one sequence, at a low-bit precision, in one call:
// RMSNorm, q/k/v (one stacked product), rotary, the K/V write, attention, o, residual, RMSNorm,
// gate/up (stacked), SiLU(gate) * up, down, residual. What Python would spend on ~25 small ops
// a layer is one call; every step is row by row, so a row's bits do not depend on the others.
#include "lowbit.h"

namespace dflash_lowbit {
namespace {

__attribute__((target("avx512f,fma")))
float sum_squares_avx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row
void rms_norm_rows(const float* x, int64_t rows, int64_t h, const float* w, float eps, float* y) {
  const bool fast = has_avx512() && h % 16 == 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float ss = 0.f;
    if (fast) {
      ss = sum_squares_avx512(xr, h);
    } else {
      for (int64_t i = 0; i < h; ++i) ss = std::fmaf(xr[i], xr[i], ss);
    }
    const float inv = 1.f / std::sqrt(ss / (float)h + eps);
    for (int64_t i = 0; i < h; ++i) y[r * h + i] = (xr[i] * inv) * w[i];
  }
}

__attribute__((target("avx512f,fma")))
void silu_mul_avx512(const float* g, const float* u, int64_t n, float* y) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
}

// y (rows, I) = silu(gu[:, :I]) * gu[:, I:]
void silu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    if (has_avx512() && inter % 16 == 0) {
      silu_mul_avx512(g, g + inter, inter, y + r * inter);
    } else {
      for (int64_t i = 0; i < inter; ++i) y[r * inter + i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
    }
  }
}

// Llama's rotation of one head's vector: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
inline void rotate(const float* x, const float* c, const float* s, int64_t dim, float* y) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + (-x[d + half]) * s[d];
  for (int64_t d = half; d < dim; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
}

}  // namespace

// x (T, H); weights: [u, d, m] of the q/k/v stack, o, the gate/up stack and down; bits: theirs;
// norms (2, H): the two RMSNorms' weights; cos, sin (T, D); k_buf, v_buf (KV, S, D): the layer's
// K/V buffer, written at past..past+T-1; mask (T, T) as attend's. Returns the layer's output (T, H).
at::Tensor llama_layer(const at::Tensor& x, at::TensorList weights, at::IntArrayRef bits, const at::Tensor& norms,
                       double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_buf,
                       const at::Tensor& v_buf, int64_t past, const c10::optional<at::Tensor>& mask, double scale,
                       int64_t heads) {
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4, "llama_layer: four weights of three tensors each");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "llama_layer: x (T, H) float32");
  const int64_t t = x.size(0), h = x.size(1), dim = cos.size(1), groups = k_buf.size(0);
  const int64_t nq = heads * dim, nkv = groups * dim;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == t && sin.sizes() == cos.sizes(),
              "llama_layer: cos and sin (T, D)");
  TORCH_CHECK(k_buf.stride(2) == 1 && k_buf.stride(1) == dim && v_buf.strides() == k_buf.strides() &&
              k_buf.size(2) == dim && past + t <= k_buf.size(1), "llama_layer: the K/V buffer does not fit");
  TORCH_CHECK(norms.is_contiguous() && norms.numel() == 2 * h, "llama_layer: norms (2, H)");
  const int64_t gu_n = weights[7].numel() / (h / QK);
  const Weight qkv = weight_of(weights[0], weights[1], weights[2], nq + 2 * nkv, h, bits[0]);
  const Weight o = weight_of(weights[3], weights[4], weights[5], h, nq, bits[1]);
  const Weight gu = weight_of(weights[6], weights[7], weights[8], gu_n, h, bits[2]);
  const Weight down = weight_of(weights[9], weights[10], weights[11], h, gu_n / 2, bits[3]);
  at::Tensor visible;
  if (mask.has_value() && mask->defined()) {
    visible = mask->to(at::kBool).contiguous();
    TORCH_CHECK(visible.size(0) == t && visible.size(1) == t, "llama_layer: mask must be (T, T)");
  }
  const float* xp = x.data_ptr<float>();
  const float* w1 = norms.data_ptr<float>();
  std::vector<float> hn(t * h), qkv_out(t * (nq + 2 * nkv)), q(t * nq), att(t * nq), proj(t * h),
      gu_out(t * gu_n), act(t * gu_n / 2);
  at::Tensor out = at::empty_like(x);
  float* y = out.data_ptr<float>();
  float* kb = k_buf.data_ptr<float>();
  float* vb = v_buf.data_ptr<float>();
  const int64_t hs = k_buf.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();

  rms_norm_rows(xp, t, h, w1, (float)eps, hn.data());
  qmm_into(hn.data(), t, qkv, qkv_out.data());
  for (int64_t r = 0; r < t; ++r) {
    const float* row = qkv_out.data() + r * (nq + 2 * nkv);
    for (int64_t a = 0; a < heads; ++a) rotate(row + a * dim, cp + r * dim, sp + r * dim, dim, q.data() + r * nq + a * dim);
    for (int64_t g = 0; g < groups; ++g) {
      rotate(row + nq + g * dim, cp + r * dim, sp + r * dim, dim, kb + g * hs + (past + r) * dim);
      std::memcpy(vb + g * hs + (past + r) * dim, row + nq + nkv + g * dim, dim * sizeof(float));
    }
  }
  attend_into(q.data(), t, heads, dim, kb, vb, groups, hs, past, visible.defined() ? visible.data_ptr<bool>() : nullptr,
              (float)scale, att.data());
  qmm_into(att.data(), t, o, proj.data());
  for (int64_t i = 0; i < t * h; ++i) y[i] = xp[i] + proj[i];
  rms_norm_rows(y, t, h, w1 + h, (float)eps, hn.data());
  qmm_into(hn.data(), t, gu, gu_out.data());
  silu_mul_rows(gu_out.data(), t, gu_n / 2, act.data());
  qmm_into(act.data(), t, down, proj.data());
  for (int64_t i = 0; i < t * h; ++i) y[i] += proj[i];
  return out;
}

}  // namespace dflash_lowbit
