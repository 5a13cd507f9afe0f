// The Llama decoder layers over the new rows of one or more sequences, at a low-bit precision, in one call.
// A layer: RMSNorm, q/k/v (one stacked product), rotary, the K/V write, attention, o, residual,
// RMSNorm, gate/up (stacked), SiLU(gate) * up, down, residual. What Python would spend on ~25
// small ops a layer, times the layers, is one call; every step is row by row, so a row's bits do
// not depend on the others.
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

__attribute__((target("avx2,fma")))
float sum_squares_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return hsum_avx2(acc);
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row
void rms_norm_rows(const float* x, int64_t rows, int64_t h, const float* w, float eps, float* y) {
  const Isa simd = isa() == Isa::avx512 && h % 16 == 0 ? Isa::avx512 : isa() != Isa::portable && h % 8 == 0
                   ? Isa::avx2 : Isa::portable;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float ss = 0.f;
    if (simd == Isa::avx512) {
      ss = sum_squares_avx512(xr, h);
    } else if (simd == Isa::avx2) {
      ss = sum_squares_avx2(xr, h);
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

__attribute__((target("avx2,fma")))
void silu_mul_avx2(const float* g, const float* u, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
}

// y (rows, I) = silu(gu[:, :I]) * gu[:, I:]
void silu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    if (has_avx512() && inter % 16 == 0) {
      silu_mul_avx512(g, g + inter, inter, y + r * inter);
    } else if (isa() == Isa::avx2 && inter % 8 == 0) {
      silu_mul_avx2(g, g + inter, inter, y + r * inter);
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

// One layer's weights, read from its 12 tensors (u, d, m of q/k/v, o, gate/up, down) and 4 bits.
struct LayerWeights {
  Weight qkv, o, gu, down;
  const float* norms;  // (2, H): the input and post-attention RMSNorms' weights
};

LayerWeights layer_weights(const at::Tensor* w, const int64_t* bits, const at::Tensor& norms, int64_t h, int64_t nq,
                           int64_t nkv) {
  TORCH_CHECK(norms.is_contiguous() && norms.numel() == 2 * h && norms.scalar_type() == at::kFloat,
              "llama_forward: norms (2, H) float32");
  const int64_t gu_n = w[7].numel() / (h / QK);
  return LayerWeights{weight_of(w[0], w[1], w[2], nq + 2 * nkv, h, bits[0]), weight_of(w[3], w[4], w[5], h, nq, bits[1]),
                      weight_of(w[6], w[7], w[8], gu_n, h, bits[2]), weight_of(w[9], w[10], w[11], h, gu_n / 2, bits[3]),
                      norms.data_ptr<float>()};
}

// The shapes of a pass: its rows are one or more sequences' new tokens (segments), each segment
// with its own K/V buffer, cached length and mask.
struct Segment {
  int64_t start, count, past;  // its rows start..start+count-1 of the pass; its cached slots
  uint16_t *k, *v;             // the layer's buffer of this sequence, (KV, S, D), fp16 (half.cpp)
  int64_t head_stride;         // S * D: its buffer's length varies by sequence
  const bool* mask;            // (count, count) or nullptr: causal
};

struct Pass {
  int64_t t, h, heads, groups, dim;
  const float *cos, *sin;  // (T, D), one row per new token
  float eps, scale;
};

// y (T, H) = the layer on x (T, H); writes each segment's new K and V at its past.. in its buffer.
void run_layer(const float* xp, float* y, const LayerWeights& w, const Pass& p, std::vector<Segment>& segs) {
  const int64_t t = p.t, h = p.h, dim = p.dim, nq = p.heads * dim, nkv = p.groups * dim, gu_n = w.gu.n;
  std::vector<float> hn(t * h), qkv_out(t * (nq + 2 * nkv)), q(t * nq), att(t * nq), proj(t * h), gu_out(t * gu_n),
      act(t * gu_n / 2), key(dim);
  rms_norm_rows(xp, t, h, w.norms, p.eps, hn.data());
  qmm_into(hn.data(), t, w.qkv, qkv_out.data());
  for (const Segment& s : segs)
    for (int64_t r = s.start; r < s.start + s.count; ++r) {
      const float* row = qkv_out.data() + r * (nq + 2 * nkv);
      const float *c = p.cos + r * dim, *sn = p.sin + r * dim;
      const int64_t slot = s.past + r - s.start;
      for (int64_t a = 0; a < p.heads; ++a) rotate(row + a * dim, c, sn, dim, q.data() + r * nq + a * dim);
      for (int64_t g = 0; g < p.groups; ++g) {
        rotate(row + nq + g * dim, c, sn, dim, key.data());
        to_half(key.data(), dim, s.k + g * s.head_stride + slot * dim);
        to_half(row + nq + nkv + g * dim, dim, s.v + g * s.head_stride + slot * dim);
      }
    }
  auto attend_segment = [&](const Segment& s) {
    attend_into(q.data() + s.start * nq, s.count, p.heads, dim, s.k, s.v, p.groups, s.head_stride, s.past, s.mask,
                p.scale, att.data() + s.start * nq);
  };
  if (segs.size() == 1) {
    attend_segment(segs[0]);  // its rows and heads in parallel
  } else {  // a segment per job (attend_into runs serially inside): the same bits either way
    at::parallel_for(0, (int64_t)segs.size(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) attend_segment(segs[i]);
    });
  }
  qmm_into(att.data(), t, w.o, proj.data());
  for (int64_t i = 0; i < t * h; ++i) y[i] = xp[i] + proj[i];
  rms_norm_rows(y, t, h, w.norms + h, p.eps, hn.data());
  qmm_into(hn.data(), t, w.gu, gu_out.data());
  silu_mul_rows(gu_out.data(), t, gu_n / 2, act.data());
  qmm_into(act.data(), t, w.down, proj.data());
  for (int64_t i = 0; i < t * h; ++i) y[i] += proj[i];
}

uint16_t* half_ptr(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>()); }

void check_buffer(const at::Tensor& k, const at::Tensor& v, int64_t layers, int64_t dim, int64_t end) {
  TORCH_CHECK(k.dim() == 5 && k.size(0) == layers && k.size(1) == 1,
              "llama_forward: each K/V buffer is (L, 1, KV, S, D) float16");
  TORCH_CHECK(k.scalar_type() == at::kHalf && k.stride(-1) == 1 && k.stride(-2) == dim && v.strides() == k.strides() &&
              v.sizes() == k.sizes() && k.size(-1) == dim && end <= k.size(-2), "llama_forward: the K/V buffer does not fit");
}

}  // namespace

// Every Llama layer in one call, over the new tokens of one or more sequences. x (T, H): the
// segments' rows one after another, `counts` of them each; weights: per layer the [u, d, m] of its
// q/k/v stack, o, gate/up stack and down, bits: theirs; norms (L, 2, H): each layer's two RMSNorm
// weights; cos, sin (T, D); k_all[i], v_all[i] (L, 1, KV, S, D) fp16: segment i's K/V buffer, written at
// pasts[i]..; masks[i] (count, count) bool: the new slots each of its rows sees (undefined: causal).
// Returns [x after the last layer, x after each layer of `keep`].
std::vector<at::Tensor> llama_forward(const at::Tensor& x, at::TensorList weights, at::IntArrayRef bits,
                                      const at::Tensor& norms, double eps, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList k_all, at::TensorList v_all, at::IntArrayRef pasts,
                                      at::IntArrayRef counts, at::TensorList masks, double scale, int64_t heads,
                                      at::IntArrayRef keep) {
  const int64_t layers = norms.size(0), nseg = (int64_t)counts.size();
  TORCH_CHECK((int64_t)weights.size() == 12 * layers && (int64_t)bits.size() == 4 * layers,
              "llama_forward: 12 weights and 4 bits a layer");
  TORCH_CHECK(nseg >= 1 && (int64_t)k_all.size() == nseg && (int64_t)v_all.size() == nseg &&
              (int64_t)pasts.size() == nseg && (masks.empty() || (int64_t)masks.size() == nseg),
              "llama_forward: one buffer, past and count per segment (and a mask each, or none)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "llama_forward: x (T, H) float32");
  const int64_t t = x.size(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == t && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == at::kFloat, "llama_forward: cos and sin (T, D) float32");
  const int64_t dim = cos.size(1);
  std::vector<at::Tensor> visible(nseg);
  int64_t start = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    check_buffer(k_all[i], v_all[i], layers, dim, pasts[i] + counts[i]);
    TORCH_CHECK(k_all[i].size(2) == k_all[0].size(2), "llama_forward: the segments' buffers disagree in K/V heads");
    if (!masks.empty() && masks[i].defined() && masks[i].numel() > 0) {
      visible[i] = masks[i].to(at::kBool).contiguous();
      TORCH_CHECK(visible[i].dim() == 2 && visible[i].size(0) == counts[i] && visible[i].size(1) == counts[i],
                  "llama_forward: segment ", i, "'s mask must be (count, count)");
    }
    start += counts[i];
  }
  TORCH_CHECK(start == t, "llama_forward: the segments' counts add up to ", start, ", x has ", t, " rows");
  const Pass p{t, x.size(1), heads, k_all[0].size(2), dim, cos.data_ptr<float>(), sin.data_ptr<float>(), (float)eps,
               (float)scale};
  std::vector<Segment> segs(nseg);
  std::vector<at::Tensor> out(1 + keep.size());
  at::Tensor a = x.clone(), b = at::empty_like(x);
  for (int64_t l = 0; l < layers; ++l) {
    const LayerWeights w = layer_weights(weights.data() + 12 * l, bits.data() + 4 * l, norms[l], p.h,
                                         heads * p.dim, p.groups * p.dim);
    for (int64_t i = 0, s0 = 0; i < nseg; s0 += counts[i], ++i)  // layer l of each buffer, by its stride (no views)
      segs[i] = Segment{s0, counts[i], pasts[i], half_ptr(k_all[i]) + l * k_all[i].stride(0),
                        half_ptr(v_all[i]) + l * v_all[i].stride(0), k_all[i].stride(2),
                        visible[i].defined() ? visible[i].data_ptr<bool>() : nullptr};
    run_layer(a.data_ptr<float>(), b.data_ptr<float>(), w, p, segs);
    std::swap(a, b);
    for (size_t j = 0; j < keep.size(); ++j)
      if (keep[j] == l) out[1 + j] = a.clone();
  }
  out[0] = a;
  return out;
}

}  // namespace dflash_lowbit
