// The rotary embedding written out in real numbers, one pass over the rows: the same operations, in the same order
// and with the same roundings, as llama/model.py's `rotate_written_out`, which a compiled step fuses into the kernels
// around it. Eagerly that function is ten torch ops over strided views, each a pass over a prompt's queries or keys;
// here it is one.
//
//   rotary(x, pairs) -> out      x (B, S, H, D) float32, its last dimension contiguous; pairs (S, D / 2, 2) or
//                                (B, S, D / 2, 2) float32, each (cos, sin). For each pair (re, im) = x[..., 2i:2i+2]:
//                                out[2i] = re * cos - im * sin, out[2i + 1] = re * sin + im * cos, every product and
//                                sum rounded to float32 on its own (no contraction into fused multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

namespace llama_kv {
namespace {

at::Tensor rotary(const at::Tensor& x, const at::Tensor& pairs_in) {
  TORCH_CHECK(x.device().is_cpu() && pairs_in.device().is_cpu(), "rotary: tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && pairs_in.scalar_type() == at::kFloat,
              "rotary: x and pairs must be float32, not ", x.scalar_type(), " and ", pairs_in.scalar_type());
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1,
              "rotary: x must be (batch, positions, heads, head_dim) with head_dim even and contiguous, not ", x.sizes());
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const bool per_row = pairs_in.dim() == 4;
  TORCH_CHECK((pairs_in.dim() == 3 && pairs_in.sizes() == at::IntArrayRef({S, D / 2, 2})) ||
                  (per_row && pairs_in.sizes() == at::IntArrayRef({B, S, D / 2, 2})),
              "rotary: pairs must be (", S, ", ", D / 2, ", 2) or (", B, ", ", S, ", ", D / 2, ", 2), not ",
              pairs_in.sizes());
  const at::Tensor pairs = pairs_in.contiguous();
  at::Tensor out = at::empty({B, S, H, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* pp = pairs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = x.stride(0), ss = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, B * S, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, H * D)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / S, s = r % S;
      const float* f = pp + (per_row ? r : s) * D;
      for (int64_t h = 0; h < H; h++) {
        const float* xr = xp + b * sb + s * ss + h * sh;
        float* o = op + (r * H + h) * D;
        for (int64_t i = 0; i < D; i += 2) {
          const float re = xr[i], im = xr[i + 1], c = f[i], sn = f[i + 1];
          o[i] = re * c - im * sn;
          o[i + 1] = re * sn + im * c;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_kv, m) { m.def("rotary(Tensor x, Tensor pairs) -> Tensor"); }
TORCH_LIBRARY_IMPL(llama_kv, CPU, m) { m.impl("rotary", &rotary); }

}  // namespace llama_kv
