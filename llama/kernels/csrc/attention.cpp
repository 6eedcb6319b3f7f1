// Attention computed one query row at a time, in one fixed order: a row's result never depends on how many
// rows came with it, or on keys its mask hides. The integer kernels need that: rounding activations to int8
// turns the 1e-7 by which batched and one-at-a-time attention otherwise differ into steps of whole int8 units
// that grow through the layers, so cached and uncached runs would part. With this op and the integer kernels
// (whose rows are independent too) they give the same bits.
//
//   attention(q, k, v, mask) -> out     q (B, H, Nq, D), k and v (B, H, Nk, D), mask additive or None, one for
//                                       all rows (Nq, Nk) or one per row (B, 1, Nq, Nk); float32 or bf16;
//                                       F.scaled_dot_product_attention's arguments and result
//
// Per row: s_j = dot(q, k_j) / sqrt(D) + mask_j over the keys whose mask is not -inf (the others are skipped:
// they would add exactly nothing), m = max s_j, e_j = exp(s_j - m), out = (sum_j e_j v_j) / (sum_j e_j), the
// sums taken over j in order. A dot product runs 8 partial sums over D and adds them in a fixed tree; the
// compiler may vectorize those loops but not reorder them (no -ffast-math, no contraction).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace llama_kv {
namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

inline float dot(const float* q, const float* k, int64_t D) {
  float lanes[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; l++) lanes[l] += q[d + l] * k[d + l];
  for (int l = 0; d < D; d++, l++) lanes[l] += q[d] * k[d];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Nk = k.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* mp = mask ? mask->data_ptr<T>() : nullptr;
  // A mask of one row for all (Nq, Nk) or one per row (B, 1, Nq, Nk): strides for row b, query i, key j.
  const bool per_row = mask && mask->dim() == 4;
  const int64_t mb = per_row ? mask->stride(0) : 0;
  const int64_t mi = mask ? mask->stride(per_row ? 2 : 0) : 0;
  const int64_t mj = mask ? mask->stride(per_row ? 3 : 1) : 0;
  const float scale = 1.0f / std::sqrt(float(D));
  const float hidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H * Nq, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, Nk * D)), [&](int64_t r0, int64_t r1) {
    std::vector<float> qrow(D), krow(D), acc(D), scores(Nk);
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / (H * Nq), h = r / Nq % H, i = r % Nq;
      const T* qi = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
      for (int64_t d = 0; d < D; d++) qrow[d] = to_float(qi[d]);
      const T* kb = kp + b * k.stride(0) + h * k.stride(1);
      const T* vb = vp + b * v.stride(0) + h * v.stride(1);
      float m = hidden;
      for (int64_t j = 0; j < Nk; j++) {
        const float mv = mp ? to_float(mp[b * mb + i * mi + j * mj]) : 0.0f;
        if (mv == hidden) {
          scores[j] = hidden;
          continue;
        }
        const T* kj = kb + j * k.stride(2);
        for (int64_t d = 0; d < D; d++) krow[d] = to_float(kj[d]);
        float s = dot(qrow.data(), krow.data(), D) * scale;
        if (mv != 0.0f) s += mv;
        scores[j] = s;
        m = std::max(m, s);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float total = 0.0f;
      for (int64_t j = 0; j < Nk; j++) {
        if (scores[j] == hidden) continue;
        const float e = std::exp(scores[j] - m);
        total += e;
        const T* vj = vb + j * v.stride(2);
        for (int64_t d = 0; d < D; d++) acc[d] += e * to_float(vj[d]);
      }
      T* oi = op + ((b * H + h) * Nq + i) * D;
      for (int64_t d = 0; d < D; d++) oi[d] = static_cast<T>(acc[d] / total);
    }
  });
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k and v must be (B, H, N, D)");
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention: tensors must be on the CPU");
  TORCH_CHECK(q_in.scalar_type() == k.scalar_type() && q_in.scalar_type() == v.scalar_type() &&
                  (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "attention: q, k and v must be all float32 or all bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q_in.size(0) && k.size(1) == q_in.size(1) && k.size(3) == q_in.size(3),
              "attention: q ", q_in.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " do not agree");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: keys and values must be contiguous along D");
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(q.scalar_type());
    const bool one = m.dim() == 2 && m.size(0) == q.size(2) && m.size(1) == k.size(2);
    const bool per_row = m.dim() == 4 && m.size(0) == q.size(0) && m.size(1) == 1 && m.size(2) == q.size(2) &&
                         m.size(3) == k.size(2);
    TORCH_CHECK(one || per_row, "attention: mask ", m.sizes(), " must be (", q.size(2), ", ", k.size(2), ") or (",
                q.size(0), ", 1, ", q.size(2), ", ", k.size(2), ")");
  }
  if (q.scalar_type() == at::kFloat)
    attend_rows<float>(q, k, v, mask.has_value() ? &m : nullptr, out);
  else
    attend_rows<at::BFloat16>(q, k, v, mask.has_value() ? &m : nullptr, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_kv, m) { m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor"); }

TORCH_LIBRARY_IMPL(llama_kv, CPU, m) { m.impl("attention", &attention); }

}  // namespace llama_kv
