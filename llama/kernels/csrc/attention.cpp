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
// compiler may vectorize those loops but not reorder them (no -ffast-math, no contraction). Where the CPU has
// AVX2 (and the kernels' path is not forced below it), float32 rows run the same operations written 8 lanes at
// a time (a multiply, then an add: the same bits): 16.9 against 27.8 us for 9 heads of 64 at 136 keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"

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

// What every row of one call shares: the tensors' data, sizes and strides, and the mask's.
template <typename T>
struct Rows {
  const T *q, *k, *v, *mask;
  T* out;
  int64_t H, Nq, D, Nk;
  int64_t qs[3], ks[3], vs[3];  // strides of b, h and the row
  int64_t mb, mi, mj;           // the mask's strides for row b, query i, key j
  float scale;
};

constexpr float kHidden = -std::numeric_limits<float>::infinity();

template <typename T>
void attend_range(const Rows<T>& a, int64_t r0, int64_t r1) {
  std::vector<float> qrow(a.D), krow(a.D), acc(a.D), scores(a.Nk);
  const int64_t D = a.D;
  for (int64_t r = r0; r < r1; r++) {
    const int64_t b = r / (a.H * a.Nq), h = r / a.Nq % a.H, i = r % a.Nq;
    const T* qi = a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    for (int64_t d = 0; d < D; d++) qrow[d] = to_float(qi[d]);
    const T* kb = a.k + b * a.ks[0] + h * a.ks[1];
    const T* vb = a.v + b * a.vs[0] + h * a.vs[1];
    float m = kHidden;
    for (int64_t j = 0; j < a.Nk; j++) {
      const float mv = a.mask ? to_float(a.mask[b * a.mb + i * a.mi + j * a.mj]) : 0.0f;
      if (mv == kHidden) {
        scores[j] = kHidden;
        continue;
      }
      const T* kj = kb + j * a.ks[2];
      for (int64_t d = 0; d < D; d++) krow[d] = to_float(kj[d]);
      float s = dot(qrow.data(), krow.data(), D) * a.scale;
      if (mv != 0.0f) s += mv;
      scores[j] = s;
      m = std::max(m, s);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    for (int64_t j = 0; j < a.Nk; j++) {
      if (scores[j] == kHidden) continue;
      const float e = std::exp(scores[j] - m);
      total += e;
      const T* vj = vb + j * a.vs[2];
      for (int64_t d = 0; d < D; d++) acc[d] += e * to_float(vj[d]);
    }
    T* oi = a.out + ((b * a.H + h) * a.Nq + i) * D;
    for (int64_t d = 0; d < D; d++) oi[d] = static_cast<T>(acc[d] / total);
  }
}

#if LLAMA_KV_X86
// `dot` 8 lanes at a time: lane l sums the products of d = l mod 8, multiplied then added, as the loop above.
LK_AVX2 inline float dot_avx2(const float* q, const float* k, int64_t D) {
  __m256 sum = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d)));
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  for (int l = 0; d < D; d++, l++) lanes[l] += q[d] * k[d];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// `attend_range` for float32, its loops over D 8 lanes at a time; every float operation is the same one.
LK_AVX2 void attend_range_avx2(const Rows<float>& a, int64_t r0, int64_t r1) {
  std::vector<float> acc(a.D), scores(a.Nk);
  const int64_t D = a.D;
  for (int64_t r = r0; r < r1; r++) {
    const int64_t b = r / (a.H * a.Nq), h = r / a.Nq % a.H, i = r % a.Nq;
    const float* qi = a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    const float* kb = a.k + b * a.ks[0] + h * a.ks[1];
    const float* vb = a.v + b * a.vs[0] + h * a.vs[1];
    float m = kHidden;
    for (int64_t j = 0; j < a.Nk; j++) {
      const float mv = a.mask ? a.mask[b * a.mb + i * a.mi + j * a.mj] : 0.0f;
      if (mv == kHidden) {
        scores[j] = kHidden;
        continue;
      }
      float s = dot_avx2(qi, kb + j * a.ks[2], D) * a.scale;
      if (mv != 0.0f) s += mv;
      scores[j] = s;
      m = std::max(m, s);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float total = 0.0f;
    for (int64_t j = 0; j < a.Nk; j++) {
      if (scores[j] == kHidden) continue;
      const float e = std::exp(scores[j] - m);
      total += e;
      const float* vj = vb + j * a.vs[2];
      const __m256 ev = _mm256_set1_ps(e);
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc.data() + d, _mm256_add_ps(_mm256_loadu_ps(acc.data() + d), _mm256_mul_ps(ev, _mm256_loadu_ps(vj + d))));
      for (; d < D; d++) acc[d] += e * vj[d];
    }
    float* oi = a.out + ((b * a.H + h) * a.Nq + i) * D;
    for (int64_t d = 0; d < D; d++) oi[d] = acc[d] / total;
  }
}
#endif

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, at::Tensor& out) {
  Rows<T> a;
  a.q = q.data_ptr<T>();
  a.k = k.data_ptr<T>();
  a.v = v.data_ptr<T>();
  a.out = out.data_ptr<T>();
  a.mask = mask ? mask->data_ptr<T>() : nullptr;
  a.H = q.size(1), a.Nq = q.size(2), a.D = q.size(3), a.Nk = k.size(2);
  for (int i = 0; i < 3; i++) a.qs[i] = q.stride(i), a.ks[i] = k.stride(i), a.vs[i] = v.stride(i);
  // A mask of one row for all (Nq, Nk) or one per row (B, 1, Nq, Nk).
  const bool per_row = mask && mask->dim() == 4;
  a.mb = per_row ? mask->stride(0) : 0;
  a.mi = mask ? mask->stride(per_row ? 2 : 0) : 0;
  a.mj = mask ? mask->stride(per_row ? 3 : 1) : 0;
  a.scale = 1.0f / std::sqrt(float(a.D));
  bool avx2 = false;
#if LLAMA_KV_X86
  avx2 = std::is_same<T, float>::value && kernel_path() >= kAvx2;
#endif
  const int64_t rows = q.size(0) * a.H * a.Nq;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, a.Nk * a.D)), [&](int64_t r0, int64_t r1) {
#if LLAMA_KV_X86
    if constexpr (std::is_same<T, float>::value) {
      if (avx2) return attend_range_avx2(a, r0, r1);
    }
#endif
    attend_range(a, r0, r1);
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

// Its C entry point for steps compiled ahead of time (see the end of ops.cpp).
extern "C" LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_attention(AtenTensorHandle q, AtenTensorHandle k,
                                                                   AtenTensorHandle v, AtenTensorHandle* mask,
                                                                   AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::attention(LLAMA_KV_TENSOR(q), LLAMA_KV_TENSOR(k), LLAMA_KV_TENSOR(v),
                                    mask ? c10::optional<at::Tensor>(LLAMA_KV_TENSOR(*mask)) : c10::nullopt));
}
