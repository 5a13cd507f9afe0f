// The operators torch.ops.dflash_lowbit.* (engine/native.py builds and loads this library).
#include <torch/library.h>

#include "lowbit.h"

namespace dflash_lowbit {
namespace {
bool fast_path() { return has_avx512(); }
}  // namespace
}  // namespace dflash_lowbit

using namespace dflash_lowbit;

TORCH_LIBRARY(dflash_lowbit, lib) {
  lib.def("qmm(Tensor x, Tensor u, Tensor d, Tensor m, int n, int bits) -> Tensor");
  lib.def("quantize(Tensor x) -> Tensor[]");
  lib.def("attend(Tensor q, Tensor k, Tensor v, int past, Tensor? mask, float scale) -> Tensor");
  lib.def("llama_forward(Tensor x, Tensor[] weights, int[] bits, Tensor norms, float eps, Tensor cos, Tensor sin, "
          "Tensor[] k_all, Tensor[] v_all, int[] pasts, int[] counts, Tensor[] masks, float scale, int heads, "
          "int[] keep) -> Tensor[]");
  lib.def("fast_path() -> bool", fast_path);
}

TORCH_LIBRARY_IMPL(dflash_lowbit, CPU, lib) {
  lib.impl("qmm", qmm);
  lib.impl("quantize", quantize);
  lib.impl("attend", attend);
  lib.impl("llama_forward", llama_forward);
}
