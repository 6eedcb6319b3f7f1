// Attention computed query row by query row, each row in one fixed order: a row's result never depends on how
// many rows came with it, on keys its mask hides, or on the number of threads. The integer kernels need that:
// rounding activations to int8 turns the 1e-7 by which batched and one-at-a-time attention otherwise differ into
// steps of whole int8 units that grow through the layers, so cached and uncached runs would part. With this op
// and the integer kernels (whose rows are independent too) they give the same bits.
//
//   attention(q, k, v, mask) -> out     q (B, H, Nq, D), k and v (B, H, Nk, D), mask additive or None, one for
//                                       all rows (Nq, Nk) or one per row (B, 1, Nq, Nk); float32 or bf16;
//                                       F.scaled_dot_product_attention's arguments and result
//
// With a float32 q, k and v may also be an int8 KV cache's rows as llama/kv_cache.py stores them, (B, H, Nk,
// D + 4 nb): each position's D values in nb blocks of D / nb, then the bytes of the blocks' float32 scales. A row is
// dequantized as load_kv does it (each value times its block's scale: one rounding) as the products read it (in
// registers on the AVX2 and AVX-512 paths, into a row's buffer on the others), so the result is the same bits as
// dequantizing the whole cache first and attending over that, while the cache is read at its own width and no float
// copy is written. k and v may likewise be a bf16 cache's rows (B, H, Nk, D) under a float32 q: widened (exactly)
// as they are read, the same bits as converting the cache to float32 first.
//
// Per row, flash attention's online softmax over blocks of kKeyBlock keys that start at multiples of kKeyBlock
// from key 0, in order (so where a block starts never depends on the rows computed together). In a block, over
// the keys whose mask is not -inf (the others are skipped: they would add exactly nothing, and a block without
// one is skipped whole, so a causal row never reads past its position):
//
//     s_j = dot(q, k_j) * (1 / sqrt(D)) + mask_j        bm = max s_j
//     if bm > m:  a = exp(m - bm), l = l * a, acc = acc * a, m = bm
//     e_j = exp(s_j - m), acc = acc + e_j * v_j                     j in order
//     l = l + sum_j e_j
//
// Keys come in parts of kPart keys (multiples of kKeyBlock, so blocks start where they did), each part with its own
// m, l and acc from -inf, 0 and 0; the parts' states are merged in key order (`merge_part`):
//
//     M = max(M, m_p),  L = L exp(M_old - M) + l_p exp(m_p - M),  ACC = ACC exp(M_old - M) + acc_p exp(m_p - M)
//
// and out = ACC / L. Parts let a decode step's few rows share one long cache among all threads (a part is work of
// its own) while a prompt's row computes the same parts one after another: the same operations either way.
//
// A dot product runs 8 partial sums over D (lane l sums d = l mod 8, in order) and adds them in the tree
// ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); the block's sum of weights is taken the same way over j (lane j mod 8,
// counted from the block's start: a hidden key's lane adds nothing). exp is `exp_neg` below, not the C library's,
// so that it can be written 8 lanes at a time with the same operations. The compiler may vectorize the loops but not reorder or
// fuse them (no -ffast-math, -ffp-contract=off: a multiply, then an add).
//
// Where the CPU has AVX2 (and the kernels' path is not forced below it), float32 and bf16 inputs (bf16 widened to
// float32, which is exact) run the same operations 8 lanes at a time, and up to kRowTile rows of one (b, h) meet
// each key block together, so that the block's keys and values are read from the cache once for all of them:
// each row's operations and their order are still exactly those above, so the scalar loop and the AVX2 one give
// the same bits, and a row gives the same bits alone (a cached step) as among all rows (an uncached pass). On
// the kernels' AVX-512 paths the same tile runs 16 lanes at a time: two keys' 8 lanes of a product in
// one vector, 16 values or weights at once, the same bits again (attention_tile.inc holds the tile for both). For
// finite inputs: NaNs propagate, but not necessarily with the same bits on every path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace llama_kv {
namespace {

constexpr int64_t kKeyBlock = 64;  // keys a row's online softmax takes at once; blocks start at its multiples
constexpr int64_t kRowTile = 8;    // most rows of one (b, h) that meet each key block together (AVX2 path)
constexpr int64_t kPart = 256;     // keys of a part (a multiple of kKeyBlock): rows meet their keys part by part
constexpr float kHidden = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r, times 2^n), within
// 2 ulp; 0 below -87, where e^x leaves float32's normal range (and it weighs nothing beside the row's max, e^0).
constexpr float kExpLow = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_neg(float x) {
  if (x < kExpLow) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; i++) p = p * r + kExpP[i];
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

inline float dot(const float* q, const float* k, int64_t D) {
  float lanes[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; l++) lanes[l] += q[d + l] * k[d + l];
  for (int l = 0; d < D; d++, l++) lanes[l] += q[d] * k[d];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// What every row of one call shares: the tensors' data, sizes and strides, and the mask's. KV is the keys' and
// values' element type: T, or int8_t for an int8 cache's rows (nb scale blocks a row).
template <typename T, typename KV = T>
struct Rows {
  const T *q, *mask;
  const KV *k, *v;
  T* out;
  int64_t H, Nq, D, Nk;
  int64_t qs[3], ks[3], vs[3];  // strides of b, h and the row
  int64_t mb, mi, mj;           // the mask's strides for row b, query i, key j
  bool stream = false;          // every key read once: prefetch ahead
  int64_t nb = 1;               // int8 rows: blocks of D / nb values, each with a float32 scale after the values
  float scale;

  float mask_at(int64_t b, int64_t i, int64_t j) const { return mask ? to_float(mask[b * mb + i * mi + j * mj]) : 0.0f; }
};

// A key or value row as float32: its values (bf16 widened, exactly), or an int8 row dequantized: value times its
// block's scale, one rounding, as llama/kv_cache.py's load_kv computes it.
template <typename T, typename KV>
inline void load_row(const Rows<T, KV>& a, const KV* x, float* y) {
  if constexpr (std::is_same<KV, int8_t>::value) {
    const int64_t bs = a.D / a.nb;
    for (int64_t b = 0; b < a.nb; b++) {
      float s;
      std::memcpy(&s, x + a.D + b * 4, sizeof s);
      for (int64_t d = b * bs; d < (b + 1) * bs; d++) y[d] = static_cast<float>(x[d]) * s;
    }
  } else {
    for (int64_t d = 0; d < a.D; d++) y[d] = to_float(x[d]);
  }
}

// A row's state over one part of its keys: its max m, its sum of weights l, then D accumulated values (not yet
// divided by l). m = -inf: the part hides every key (l and the values are then 0).
inline float* state_values(float* st) { return st + 2; }
inline const float* state_values(const float* st) { return st + 2; }

// The reference: row i of (b, h) over keys j_begin .. j_end (a part: both multiples of kKeyBlock, or j_end = Nk),
// exactly the operations of the header, one at a time, into its state st.
template <typename T, typename KV>
void attend_part_row(const Rows<T, KV>& a, int64_t b, int64_t h, int64_t i, int64_t j_begin, int64_t j_end,
                     float* qrow, float* krow, float* vrow, float* s, float* st) {
  const int64_t D = a.D;
  const T* qi = a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
  for (int64_t d = 0; d < D; d++) qrow[d] = to_float(qi[d]);
  const KV* kb = a.k + b * a.ks[0] + h * a.ks[1];
  const KV* vb = a.v + b * a.vs[0] + h * a.vs[1];
  float m = kHidden, l = 0.0f;
  float* acc = state_values(st);
  std::fill(acc, acc + D, 0.0f);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, j_end - j0);
    float bm = kHidden;
    for (int64_t j = 0; j < n; j++) {
      const float mv = a.mask_at(b, i, j0 + j);
      if (mv == kHidden) {
        s[j] = kHidden;
        continue;
      }
      load_row(a, kb + (j0 + j) * a.ks[2], krow);
      s[j] = dot(qrow, krow, D) * a.scale + mv;
      bm = std::max(bm, s[j]);
    }
    if (bm == kHidden) continue;
    if (bm > m) {
      const float alpha = exp_neg(m - bm);
      l *= alpha;
      for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
      m = bm;
    }
    float lanes[8] = {};
    for (int64_t j = 0; j < n; j++) {
      if (s[j] == kHidden) continue;
      const float e = exp_neg(s[j] - m);
      lanes[j % 8] += e;
      load_row(a, vb + (j0 + j) * a.vs[2], vrow);
      for (int64_t d = 0; d < D; d++) acc[d] += e * vrow[d];
    }
    l += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  st[0] = m, st[1] = l;
}

// Folds a part's state into the row's running one (parts taken in key order; every path calls this one function):
//     M' = max(M, m),  L' = L exp(M - M') + l exp(m - M'),  ACC' = ACC exp(M - M') + acc exp(m - M')
// A part that hides every key is skipped, and the first one seen is taken as it is.
inline void merge_part(float* into, const float* part, int64_t D) {
  const float m = part[0];
  if (m == kHidden) return;
  float* acc = state_values(into);
  const float* add = state_values(part);
  if (into[0] == kHidden) {
    std::memcpy(into, part, (D + 2) * sizeof(float));
    return;
  }
  const float top = std::max(into[0], m), a = exp_neg(into[0] - top), c = exp_neg(m - top);
  into[0] = top;
  into[1] = into[1] * a + part[1] * c;
  for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * a + add[d] * c;
}

inline void empty_state(float* st, int64_t D) {
  st[0] = kHidden;
  std::fill(st + 1, st + D + 2, 0.0f);
}

template <typename T>
inline void finish_row(const float* st, int64_t D, T* out) {
  const float* acc = state_values(st);
  for (int64_t d = 0; d < D; d++) out[d] = static_cast<T>(acc[d] / st[1]);
}

#if LLAMA_KV_X86
// `exp_neg` 8 lanes at a time: the same operations on each lane.
LK_AVX2 inline __m256 exp_neg8(__m256 x) {
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpP[i]));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(low, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

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

// A block's keys or values as the tile's products read them: 8 (or 16) values of its row j from d, as float32 in
// registers, never stored: float32 rows in place, bf16 rows widened (exact), an int8 cache's rows dequantized as
// `load_row` does it (each value times its block's scale, one rounding). So a bf16 or int8 cache is read once, at
// its own width, with the same values and operations as widening the block first. A 16-value load stays in one
// scale block: blocks are D or 32 values (llama/kv_cache.py), and 16-value loads start at multiples of 16.
template <typename KV>
struct Block;

template <>
struct Block<float> {
  const float* p;
  int64_t stride;
  LK_AVX2 __m256 load8(int64_t j, int64_t d) const { return _mm256_loadu_ps(p + j * stride + d); }
  LK_AVX512F __m512 load16(int64_t j, int64_t d) const { return _mm512_loadu_ps(p + j * stride + d); }
};

template <>
struct Block<at::BFloat16> {
  const at::BFloat16* p;
  int64_t stride;
  LK_AVX2 __m256 load8(int64_t j, int64_t d) const {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * stride + d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
  }
  LK_AVX512F __m512 load16(int64_t j, int64_t d) const {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * stride + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  }
};

template <>
struct Block<int8_t> {
  const int8_t* p;
  int64_t stride, D, bs;  // D values a row, then the float32 scales of its blocks of bs values
  float scale_at(const int8_t* x, int64_t d) const {
    float s;
    std::memcpy(&s, x + D + d / bs * 4, sizeof s);
    return s;
  }
  LK_AVX2 __m256 load8(int64_t j, int64_t d) const {
    const int8_t* x = p + j * stride;
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + d)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(scale_at(x, d)));
  }
  LK_AVX512F __m512 load16(int64_t j, int64_t d) const {
    const int8_t* x = p + j * stride;
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(scale_at(x, d)));
  }
};

// s[r][c] = dot(q[r], k_c) * scale + s[r][c] for NR rows and 4 keys (k_c = the block's row j + c), D a multiple of
// 8: `dot_avx2`'s lanes, summed by two horizontal adds in `dot`'s tree (hadd(a, b) adds lanes 2t and 2t + 1).
template <int NR, typename KV>
LK_AVX2 inline void dots_x4(const float* const* q, const Block<KV>& k, int64_t j, int64_t D, float scale,
                            float* const* s) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[4];
    for (int c = 0; c < 4; c++) kv[c] = k.load8(j + c, d);
    for (int r = 0; r < NR; r++) {
      const __m256 qv = _mm256_loadu_ps(q[r] + d);
      for (int c = 0; c < 4; c++) acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_mul_ps(qv, kv[c]));
    }
  }
  for (int r = 0; r < NR; r++) {
    // lanes of g: key c's ((0 + 1) + (2 + 3)) at c, its ((4 + 5) + (6 + 7)) at 4 + c
    const __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
    _mm_storeu_ps(s[r], _mm_add_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), _mm_loadu_ps(s[r])));
  }
}

// acc[r][d0 .. d0 + 8 NC) += e[r][j] * v_j for NR rows, j = 0 .. n in order (v_j = the block's row j).
template <int NR, int NC, typename KV>
LK_AVX2 inline void values_tile(float* const* acc, const float* const* e, const Block<KV>& v, int64_t n, int64_t d0) {
  __m256 sum[NR][NC];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < NC; c++) sum[r][c] = _mm256_loadu_ps(acc[r] + d0 + 8 * c);
  for (int64_t j = 0; j < n; j++) {
    __m256 vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = v.load8(j, d0 + 8 * c);
    for (int r = 0; r < NR; r++) {
      const __m256 ev = _mm256_broadcast_ss(e[r] + j);
      for (int c = 0; c < NC; c++) sum[r][c] = _mm256_add_ps(sum[r][c], _mm256_mul_ps(ev, vv[c]));
    }
  }
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(acc[r] + d0 + 8 * c, sum[r][c]);
}

template <int NR, typename KV>
LK_AVX2 void values_rows(float* const* acc, const float* const* e, const Block<KV>& v, int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) values_tile<NR, 2>(acc, e, v, n, d0);
  for (; d0 + 8 <= D; d0 += 8) values_tile<NR, 1>(acc, e, v, n, d0);
}

// acc += e * v over D, 8 lanes at a time, the tail one by one: the same operation on every element.
LK_AVX2 inline void add_scaled(float* acc, float e, const float* v, int64_t D) {
  const __m256 ev = _mm256_set1_ps(e);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(ev, _mm256_loadu_ps(v + d))));
  for (; d < D; d++) acc[d] += e * v[d];
}

LK_AVX2 inline void widen(const float* x, float* y, int64_t n) { std::memcpy(y, x, n * sizeof(float)); }

LK_AVX2 inline void widen(const at::BFloat16* x, float* y, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; i++) y[i] = static_cast<float>(x[i]);
}

// `load_row` 8 values at a time: int8 widened to float32 (exact), times the block's scale.
template <typename T, typename KV>
LK_AVX2 inline void widen_row(const Rows<T, KV>& a, const KV* x, float* y) {
  if constexpr (std::is_same<KV, int8_t>::value) {
    const int64_t bs = a.D / a.nb;
    for (int64_t b = 0; b < a.nb; b++) {
      float s;
      std::memcpy(&s, x + a.D + b * 4, sizeof s);
      const __m256 s8 = _mm256_set1_ps(s);
      int64_t d = b * bs;
      for (; d + 8 <= (b + 1) * bs; d += 8) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + d)));
        _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s8));
      }
      for (; d < (b + 1) * bs; d++) y[d] = static_cast<float>(x[d]) * s;
    }
  } else {
    widen(x, y, a.D);
  }
}

// The block of rows from x (row stride `stride`) of the call's keys or values, as the tile's products read it.
template <typename T, typename KV>
inline Block<KV> block(const Rows<T, KV>& a, const KV* x, int64_t stride) {
  if constexpr (std::is_same<KV, int8_t>::value)
    return Block<KV>{x, stride, a.D, a.D / a.nb};
  else
    return Block<KV>{x, stride};
}

// Row j of a block as float32 for the one-key-at-a-time paths: in place, or widened into buf (D values).
template <typename T, typename KV>
LK_AVX2 inline const float* float_row(const Rows<T, KV>& a, const Block<KV>& x, int64_t j, float* buf) {
  if constexpr (std::is_same<KV, float>::value) {
    return x.p + j * x.stride;
  } else {
    widen_row(a, x.p + j * x.stride, buf);
    return buf;
  }
}

// s[0 .. n) = row i's mask over keys j0 .. j0 + n (0 without one); returns how many of them it does not hide.
template <typename T, typename KV>
LK_AVX2 int64_t mask_block(const Rows<T, KV>& a, int64_t b, int64_t i, int64_t j0, int64_t n, float* s) {
  if (!a.mask) {
    std::fill(s, s + n, 0.0f);
    return n;
  }
  const T* mrow = a.mask + b * a.mb + i * a.mi + j0 * a.mj;
  if (a.mj != 1) {
    for (int64_t j = 0; j < n; j++) s[j] = to_float(mrow[j * a.mj]);
  } else {
    widen(mrow, s, n);
  }
  int64_t hidden = 0, j = 0;
  for (; j + 8 <= n; j += 8)
    hidden += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(kHidden), _CMP_EQ_OQ)));
  for (; j < n; j++) hidden += s[j] == kHidden;
  return n - hidden;
}

// Asks for n rows of `bytes` bytes each (stride `stride` elements) to be brought into the caches, without waiting:
// each cache line once where the rows lie back to back.
template <typename KV>
LK_AVX2 inline void prefetch_rows(const KV* x, int64_t stride, int64_t n, int64_t bytes) {
  if (stride * int64_t(sizeof(KV)) == bytes) {
    prefetch_lines(x, n * bytes);
    return;
  }
  for (int64_t j = 0; j < n; j++) prefetch_lines(x + j * stride, bytes);
}

// A thread's buffers for one tile of rows: their queries (widened), scores and weights of one key block, and
// (bf16, int8) a key and a value row widened for the paths that take keys one at a time.
struct Tile {
  std::vector<float> q, s, e, k, v;
  Tile(int64_t D) : q(kRowTile * D), s(kRowTile * kKeyBlock), e(kRowTile * kKeyBlock), k(D), v(D) {}
};

// e[j .. n) = exp(s_j - m), added onto `sum8`'s lanes, and the sum of all as `dot` sums (8 lanes, key j in lane
// j mod 8, then the tree). A hidden key's weight is +0, which changes no sum: adding it is skipping it.
LK_AVX2 inline float finish_weights(__m256 sum8, const float* s, float* e, int64_t j, int64_t n, float m) {
  const __m256 m8 = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) {
    const __m256 e8 = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
    _mm256_storeu_ps(e + j, e8);
    sum8 = _mm256_add_ps(sum8, e8);
  }
  float lane[8];
  _mm256_storeu_ps(lane, sum8);
  for (int c = 0; j < n; j++, c++) {
    e[j] = exp_neg(s[j] - m);
    lane[c] += e[j];
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

LK_AVX2 inline float weights_avx2(const float* s, float* e, int64_t n, float m) {
  return finish_weights(_mm256_setzero_ps(), s, e, 0, n, m);
}

#define LK_TILE_TARGET LK_AVX2
#define LK_TILE attend_tile_avx2
#define LK_KEYS 4
#define LK_DOTS dots_x4
#define LK_DOT_ROWS 2
#define LK_VALUES values_rows
#define LK_WEIGHTS weights_avx2
#include "attention_tile.inc"

// The same operations 16 lanes at a time. Each lane of `exp_neg16` does `exp_neg8`'s; the products hold two keys
// in a vector, each half `dot_avx2`'s 8 lanes; values and weights are elementwise, 16 of them at a time.
LK_AVX512F inline __m512 exp_neg16(__m512 x) {
  const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kLn2Hi))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kLn2Lo)));
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; i++) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpP[i]));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(_mm512_knot(low), _mm512_mul_ps(y, _mm512_castsi512_ps(bits)));
}

LK_AVX512F inline __m256 low_half(__m512 x) { return _mm512_castps512_ps256(x); }
LK_AVX512F inline __m256 high_half(__m512 x) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}
LK_AVX512F inline __m512 two_halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// `dots_x4` for 8 keys: keys 2c and 2c + 1 in the halves of acc[r][c], each half `dot_avx2`'s lanes, then each
// half's four keys summed by `dots_x4`'s horizontal adds.
template <int NR, typename KV>
LK_AVX512F inline void dots_x8(const float* const* q, const Block<KV>& k, int64_t j, int64_t D, float scale,
                               float* const* s) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 kv[4];
    for (int c = 0; c < 4; c++)
      kv[c] = two_halves(k.load8(j + 2 * c, d), k.load8(j + 2 * c + 1, d));
    for (int r = 0; r < NR; r++) {
      const __m256 q8 = _mm256_loadu_ps(q[r] + d);
      const __m512 qv = two_halves(q8, q8);
      for (int c = 0; c < 4; c++) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(qv, kv[c]));
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int g = 0; g < 2; g++) {  // keys 4g .. 4g + 3
      const __m512 ab = acc[r][2 * g], cd = acc[r][2 * g + 1];
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(low_half(ab), high_half(ab)),
                                      _mm256_hadd_ps(low_half(cd), high_half(cd)));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
      _mm_storeu_ps(s[r] + 4 * g, _mm_add_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), _mm_loadu_ps(s[r] + 4 * g)));
    }
  }
}

// `values_tile` 16 values a vector: acc[r][d0 .. d0 + 16 NC) += e[r][j] * v_j, j in order.
template <int NR, int NC, typename KV>
LK_AVX512F inline void values_tile512(float* const* acc, const float* const* e, const Block<KV>& v, int64_t n,
                                      int64_t d0) {
  __m512 sum[NR][NC];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < NC; c++) sum[r][c] = _mm512_loadu_ps(acc[r] + d0 + 16 * c);
  for (int64_t j = 0; j < n; j++) {
    __m512 vv[NC];
    for (int c = 0; c < NC; c++) vv[c] = v.load16(j, d0 + 16 * c);
    for (int r = 0; r < NR; r++) {
      const __m512 ev = _mm512_set1_ps(e[r][j]);
      for (int c = 0; c < NC; c++) sum[r][c] = _mm512_add_ps(sum[r][c], _mm512_mul_ps(ev, vv[c]));
    }
  }
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc[r] + d0 + 16 * c, sum[r][c]);
}

template <int NR, typename KV>
LK_AVX512F void values_rows512(float* const* acc, const float* const* e, const Block<KV>& v, int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_tile512<NR, 4>(acc, e, v, n, d0);
  for (; d0 + 16 <= D; d0 += 16) values_tile512<NR, 1>(acc, e, v, n, d0);
  for (; d0 + 8 <= D; d0 += 8) values_tile<NR, 1>(acc, e, v, n, d0);
}

// `weights_avx2` 16 keys a vector: each vector's two halves added into the 8 lanes in key order.
LK_AVX512F inline float weights_avx512(const float* s, float* e, int64_t n, float m) {
  const __m512 m16 = _mm512_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e16 = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
    _mm512_storeu_ps(e + j, e16);
    sum8 = _mm256_add_ps(_mm256_add_ps(sum8, low_half(e16)), high_half(e16));
  }
  return finish_weights(sum8, s, e, j, n, m);
}

#define LK_TILE_TARGET LK_AVX512F
#define LK_TILE attend_tile_avx512
#define LK_KEYS 8
#define LK_DOTS dots_x8
#define LK_DOT_ROWS 4
#define LK_VALUES values_rows512
#define LK_WEIGHTS weights_avx512
#include "attention_tile.inc"
#endif

// A thread's buffers: the scalar loop's row of q, key, value and scores, or the AVX2 path's tile.
struct Scratch {
  std::vector<float> q, k, v, s;
#if LLAMA_KV_X86
  std::unique_ptr<Tile> tile;
#endif
  Scratch(int64_t D, bool avx2) : q(D), k(D), v(D), s(kKeyBlock) {
#if LLAMA_KV_X86
    if (avx2) tile.reset(new Tile(D));
#endif
  }
};

template <typename T, typename KV = T>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, at::Tensor& out,
                 int64_t nb = 1) {
  Rows<T, KV> a;
  a.q = q.data_ptr<T>();
  a.k = k.data_ptr<KV>();
  a.v = v.data_ptr<KV>();
  a.nb = nb;
  a.out = out.data_ptr<T>();
  a.mask = mask ? mask->data_ptr<T>() : nullptr;
  a.H = q.size(1), a.Nq = q.size(2), a.D = q.size(3), a.Nk = k.size(2);  // int8 rows: D values, then scales
  for (int i = 0; i < 3; i++) a.qs[i] = q.stride(i), a.ks[i] = k.stride(i), a.vs[i] = v.stride(i);
  // A mask of one row for all (Nq, Nk) or one per row (B, 1, Nq, Nk).
  const bool per_row = mask && mask->dim() == 4;
  a.mb = per_row ? mask->stride(0) : 0;
  a.mi = mask ? mask->stride(per_row ? 2 : 0) : 0;
  a.mj = mask ? mask->stride(per_row ? 3 : 1) : 0;
  a.scale = 1.0f / std::sqrt(float(a.D));
  bool avx2 = false, avx512 = false;
#if LLAMA_KV_X86
  avx2 = kernel_path() >= kAvx2;
  avx512 = kernel_path() >= kAvx512;
#endif
  // Rows are taken in tiles of up to kRowTile rows of one (b, h), so that each key block is read from memory (and an
  // int8 one dequantized) once for all of them, not once a row; within a (b, h) tiles are taken from both ends in
  // turn, so that a thread's contiguous share of a causal mask's triangle holds short and long rows alike. A tile
  // meets its keys in parts of kPart keys, each part's states merged into the rows' running ones in key order.
  // Where tiles are many (a prompt, a batch of decode steps) a thread takes whole tiles, part after part. Where they
  // are few (one decode step: 3 tiles of the default model's 3 key heads for 2 threads) each (tile, part) is work
  // of its own, spread over the threads, its states kept, then merged in the same order by the same function:
  // the same bits, and every thread streaming its share of the cache (at 2,048 keys that share is what bounds
  // the step: the cache no longer fits in the caches, and one thread alone reads it at a third of memory's speed).
  // How rows are grouped and parts shared out changes no bit, so both are chosen for speed.
  const int64_t BH = q.size(0) * a.H, threads = at::get_num_threads();
  const int64_t R = avx2 ? std::clamp<int64_t>(a.Nq, 1, kRowTile) : 1;
  const int64_t tiles = (a.Nq + R - 1) / R, parts = (a.Nk + kPart - 1) / kPart, S = a.D + 2;
  const bool spread = threads > 1 && parts > 1 && BH * tiles < 4 * threads;
  a.stream = tiles == 1;
  // Rows i0 .. i1 of (b, h) over part p, into states st.
  auto attend_part = [&](int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t p, Scratch& x, float* const* st) {
    const int64_t j_begin = p * kPart, j_end = std::min(j_begin + kPart, a.Nk);
#if LLAMA_KV_X86
    if (avx512) {
      attend_tile_avx512(a, b, h, i0, i1, j_begin, j_end, *x.tile, st);
      return;
    }
    if (avx2) {
      attend_tile_avx2(a, b, h, i0, i1, j_begin, j_end, *x.tile, st);
      return;
    }
#endif
    for (int64_t i = i0; i < i1; i++)
      attend_part_row(a, b, h, i, j_begin, j_end, x.q.data(), x.k.data(), x.v.data(), x.s.data(), st[i - i0]);
  };
  auto tile_rows = [&](int64_t w, int64_t& b, int64_t& h, int64_t& i0, int64_t& i1) {
    const int64_t bh = w / tiles, u = w % tiles;
    b = bh / a.H, h = bh % a.H;
    i0 = (u % 2 == 0 ? u / 2 : tiles - 1 - u / 2) * R, i1 = std::min(i0 + R, a.Nq);
  };
  auto write_rows = [&](int64_t b, int64_t h, int64_t i0, int64_t i1, float* const* st) {
    for (int64_t i = i0; i < i1; i++) finish_row(st[i - i0], a.D, a.out + ((b * a.H + h) * a.Nq + i) * a.D);
  };
  if (!spread) {
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, R * a.Nk * a.D));
    at::parallel_for(0, BH * tiles, grain, [&](int64_t w0, int64_t w1) {
      Scratch x(a.D, avx2);
      std::vector<float> buf(2 * R * S);
      float *run[kRowTile], *cur[kRowTile];
      for (int64_t r = 0; r < R; r++) run[r] = buf.data() + r * S, cur[r] = buf.data() + (R + r) * S;
      for (int64_t w = w0; w < w1; w++) {
        int64_t b, h, i0, i1;
        tile_rows(w, b, h, i0, i1);
        for (int64_t r = 0; r < i1 - i0; r++) empty_state(run[r], a.D);
        for (int64_t p = 0; p < parts; p++) {
          attend_part(b, h, i0, i1, p, x, cur);
          for (int64_t r = 0; r < i1 - i0; r++) merge_part(run[r], cur[r], a.D);
        }
        write_rows(b, h, i0, i1, run);
      }
    });
    return;
  }
  std::vector<float> states(BH * tiles * parts * R * S);
  auto state = [&](int64_t w, int64_t p, int64_t r) { return states.data() + ((w * parts + p) * R + r) * S; };
  at::parallel_for(0, BH * tiles * parts, 1, [&](int64_t w0, int64_t w1) {
    Scratch x(a.D, avx2);
    for (int64_t wp = w0; wp < w1; wp++) {
      const int64_t w = wp / parts, p = wp % parts;
      int64_t b, h, i0, i1;
      tile_rows(w, b, h, i0, i1);
      float* st[kRowTile];
      for (int64_t r = 0; r < i1 - i0; r++) st[r] = state(w, p, r);
      attend_part(b, h, i0, i1, p, x, st);
    }
  });
  std::vector<float> run(R * S);
  for (int64_t w = 0; w < BH * tiles; w++) {
    int64_t b, h, i0, i1;
    tile_rows(w, b, h, i0, i1);
    float* rs[kRowTile];
    for (int64_t r = 0; r < i1 - i0; r++) {
      rs[r] = run.data() + r * S;
      empty_state(rs[r], a.D);
      for (int64_t p = 0; p < parts; p++) merge_part(rs[r], state(w, p, r), a.D);
    }
    write_rows(b, h, i0, i1, rs);
  }
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k and v must be (B, H, N, D)");
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention: tensors must be on the CPU");
  const bool rows8 = k.scalar_type() == at::kChar;  // an int8 cache's rows: D values, then nb float32 scales
  // a bf16 cache's rows under float32 queries
  const bool rows16 = q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16;
  const int64_t D = q_in.size(3), nb = D % 32 == 0 ? D / 32 : 1;  // llama/kv_cache.py's blocks
  TORCH_CHECK(rows8 || rows16 ? q_in.scalar_type() == at::kFloat && v.scalar_type() == k.scalar_type()
                              : q_in.scalar_type() == k.scalar_type() && q_in.scalar_type() == v.scalar_type() &&
                                    (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "attention: q, k and v must be all float32 or all bfloat16, or a float32 q with int8 or bfloat16 rows "
              "of k and v");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q_in.size(0) && k.size(1) == q_in.size(1) &&
                  k.size(3) == (rows8 ? D + 4 * nb : D),
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
  if (rows8)
    attend_rows<float, int8_t>(q, k, v, mask.has_value() ? &m : nullptr, out, nb);
  else if (rows16)
    attend_rows<float, at::BFloat16>(q, k, v, mask.has_value() ? &m : nullptr, out);
  else if (q.scalar_type() == at::kFloat)
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
