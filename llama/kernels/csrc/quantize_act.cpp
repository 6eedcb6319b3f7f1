// Activations rounded to int8 per block of 32 (Q8_0's rule), inside every product: one job, two paths.
//
// Per block: amax = max |x|, d = amax / 127, q = round-half-even(x * (127 / amax)), sum = sum of q, s = d * sum.
// A block where 127 / amax overflows (all zeros, or amax below about 2^-121) has d = 0 and q = 0; a block
// holding NaN or an infinity has d = NaN and q = 0, so the outputs it reaches are NaN (as a float product
// would make them). Every step is one correctly rounded
// float32 operation, so the AVX2 path equals the scalar loop, and a torch reference equals both.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace llama_kv {

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void quantize_block_scalar(const float* x, int8_t* q, float* d, int32_t* sum, float* s) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < QK; i++) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (!finite) {
    std::memset(q, 0, QK);
    *d = NAN;
    *sum = 0;
    *s = NAN;
    return;
  }
  const float id = 127.0f / amax;
  if (std::isinf(id)) {
    std::memset(q, 0, QK);
    *d = *s = 0.0f;
    *sum = 0;
    return;
  }
  int32_t total = 0;
  for (int i = 0; i < QK; i++) {
    const int v = int(std::nearbyint(x[i] * id));  // the current rounding mode: to nearest, ties to even
    q[i] = int8_t(v);
    total += v;
  }
  *d = amax / 127.0f;
  *sum = total;
  *s = *d * float(total);
}

#if LLAMA_KV_X86
// Four vectors of 8 floats -> 32 int8 in order, and their sum; false if any value is NaN or infinite.
LK_AVX2 inline bool quantize_block_avx2(__m256 v0, __m256 v1, __m256 v2, __m256 v3, int8_t* q, float* d,
                                        int32_t* sum, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  // Not finite: |x| == inf, or x is NaN (unordered with itself). max_ps would drop a NaN, so test apart.
  __m256 bad = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                            _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
  bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_EQ_OQ));
  if (_mm256_movemask_ps(bad)) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float amax = _mm_cvtss_f32(m);
  const float inv = 127.0f / amax;
  if (std::isinf(inv)) {
    std::memset(q, 0, QK);
    *d = *s = 0.0f;
    *sum = 0;
    return true;
  }
  const __m256 id = _mm256_set1_ps(inv);
  // cvtps rounds in the current mode (to nearest, ties to even), as nearbyint does in the scalar loop.
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 1));
  const int32_t total = _mm_cvtsi128_si32(t4);
  // packs work within 128-bit lanes: the bytes come out as 4-value runs of i0, i1, i2, i3 per lane, and
  // one permutation of 32-bit words puts them back in order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = amax / 127.0f;
  *sum = total;
  *s = *d * float(total);
  return true;
}

LK_AVX2 void quantize_row_f32_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s) {
  for (int64_t b = 0; b < K / QK; b++) {
    const float* xb = x + b * QK;
    if (!quantize_block_avx2(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                             _mm256_loadu_ps(xb + 24), q + b * QK, d + b, sum + b, s + b))
      quantize_block_scalar(xb, q + b * QK, d + b, sum + b, s + b);
  }
}

LK_AVX2 inline __m256 bf16x8(const uint16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

LK_AVX2 void quantize_row_bf16_avx2(const uint16_t* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s) {
  for (int64_t b = 0; b < K / QK; b++) {
    const uint16_t* xb = x + b * QK;
    if (!quantize_block_avx2(bf16x8(xb), bf16x8(xb + 8), bf16x8(xb + 16), bf16x8(xb + 24), q + b * QK, d + b,
                             sum + b, s + b)) {
      float wide[QK];
      for (int i = 0; i < QK; i++) wide[i] = bf16_to_float(xb[i]);
      quantize_block_scalar(wide, q + b * QK, d + b, sum + b, s + b);
    }
  }
}
#endif

}  // namespace

void quantize_row_f32(int path, const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s) {
#if LLAMA_KV_X86
  if (path != kScalar) return quantize_row_f32_avx2(x, K, q, d, sum, s);  // every SIMD path has AVX2
#endif
  for (int64_t b = 0; b < K / QK; b++) quantize_block_scalar(x + b * QK, q + b * QK, d + b, sum + b, s + b);
}

void quantize_row_bf16(int path, const uint16_t* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s) {
#if LLAMA_KV_X86
  if (path != kScalar) return quantize_row_bf16_avx2(x, K, q, d, sum, s);
#endif
  float wide[QK];
  for (int64_t b = 0; b < K / QK; b++) {
    for (int i = 0; i < QK; i++) wide[i] = bf16_to_float(x[b * QK + i]);
    quantize_block_scalar(wide, q + b * QK, d + b, sum + b, s + b);
  }
}

}  // namespace llama_kv
