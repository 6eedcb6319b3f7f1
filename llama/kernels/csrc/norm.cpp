// RMSNorm computed one row at a time, in one fixed order: a row's result never depends on how many rows came
// with it, or on whether the step around it is compiled. torch's own rms_norm and the reduction Inductor
// generates for it sum the squares in different orders, so a compiled decode step and the eager uncached pass
// differed in the last bit of some normalised values; rounding activations to int8 then turned that into
// different tokens. With this op (and the row-exact attention, rotary and integer products) both give the
// same bits.
//
//   rms_norm(x, weight, eps) -> out      x (..., K) and weight (K) both float32 or both bfloat16:
//                                        out = (x * 1 / sqrt(mean(x^2) + eps)) * weight, as Meta's RMSNorm
//                                        (normalised in float32, rounded to x's dtype, then times the weight)
//
// The squares are summed in 16 partial sums over K, added in a fixed tree; the compiler may vectorize that
// loop but not reorder it (no -ffast-math, no contraction), so every build and path gives the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace llama_kv {
namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t K, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K)), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(K);
    for (int64_t r = r0; r < r1; r++) {
      const T* xr = x + r * K;
      for (int64_t d = 0; d < K; d++) row[d] = to_float(xr[d]);
      float lanes[16] = {};
      int64_t d = 0;
      for (; d + 16 <= K; d += 16)
        for (int l = 0; l < 16; l++) lanes[l] += row[d + l] * row[d + l];
      for (int l = 0; d < K; d++, l++) lanes[l] += row[d] * row[d];
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
      const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(K) + eps);
      T* o = out + r * K;
      for (int64_t k = 0; k < K; k++) o[k] = static_cast<T>(to_float(static_cast<T>(row[k] * scale)) * to_float(weight[k]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && weight_in.device().is_cpu(), "rms_norm: tensors must be on the CPU");
  TORCH_CHECK(x_in.dim() >= 1 && weight_in.dim() == 1 && weight_in.size(0) == x_in.size(-1),
              "rms_norm: weight ", weight_in.sizes(), " does not match x ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == weight_in.scalar_type() &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight must be both float32 or both bfloat16");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, K, float(eps));
  else
    norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                            rows, K, float(eps));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_kv, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(llama_kv, CPU, m) { m.impl("rms_norm", &rms_norm); }

}  // namespace llama_kv

// Its C entry point for steps compiled ahead of time (see the end of ops.cpp).
extern "C" LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight,
                                                                  double eps, AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::rms_norm(LLAMA_KV_TENSOR(x), LLAMA_KV_TENSOR(weight), eps));
}
