// AVX2 block products: int8 x int8 through maddubs with the sign trick, int4 x int8 through maddubs on the
// unsigned nibbles, one half of a unit (8 rows) at a time. Each 32-bit lane holds one weight row, so each row's sums are the scalar loop's.
//
// maddubs multiplies unsigned by signed bytes and adds pairs into int16 with saturation. int8 weights are
// signed, so it gets |w| and the activation with w's sign (sign_epi8): a pair is at most 2 * 128 * 127 =
// 32512, below the saturation at 32767 (activations are -127..127, never -128). int4 values are 0..15: a
// pair is at most 2 * 15 * 127 = 3810, so a block's eight int16 partial sums stay below 30480 and can be
// added in int16 before one widening.
#include <cstring>

#include "kernels.h"

namespace llama_kv {

#if LLAMA_KV_X86
namespace {

LK_AVX2 inline __m256i broadcast_word(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

LK_AVX2 inline __m256 halves8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One group (8 rows) against MT activation rows: out[m][r]. kHalves: int8 in groups of 16, each half of a block
// (columns 0-15, 16-31) scaled apart.
template <int MT, bool kHalves>
LK_AVX2 void q8_0_group(const int8_t* wg, const uint16_t* sg, int64_t nb, const ActRow* act, float (*out)[ROWS],
                        const int8_t* next) {
  __m256 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; b++) {
    const int8_t* wb = wg + b * Q8_BLOCK_BYTES;
    prefetch_lines(next ? next + b * Q8_BLOCK_BYTES : nullptr, Q8_BLOCK_BYTES);
    __m256i isum[MT][2];  // columns 0-15 (runs 0-3) and 16-31 (runs 4-7)
    for (int m = 0; m < MT; m++) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < QK / 4; j++) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MT; m++) {
        const __m256i a = broadcast_word(act[m].q + b * QK + 4 * j);
        const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, w));
        isum[m][j / 4] = _mm256_add_epi32(isum[m][j / 4], _mm256_madd_epi16(pairs, ones));
      }
    }
    if (kHalves) {
      for (int h = 0; h < 2; h++) {
        const __m256 dw = halves8(sg + (2 * b + h) * ROWS);
        for (int m = 0; m < MT; m++)
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(act[m].d[b])), _mm256_cvtepi32_ps(isum[m][h]), acc[m]);
      }
    } else {
      const __m256 dw = halves8(sg + b * ROWS);
      for (int m = 0; m < MT; m++) {
        const __m256i total = _mm256_add_epi32(isum[m][0], isum[m][1]);  // integers: the same sum in any order
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(act[m].d[b])), _mm256_cvtepi32_ps(total), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out[m], acc[m]);
}

// Half h (8 rows) of an int4 unit against MT activation rows: out[m][r]. Q4_0 (kMins false) takes 8 * asum off
// each block's integer sum; Q4_1 adds its minimum's term.
template <int MT, bool kMins>
LK_AVX2 void q4_half(const uint8_t* unit, int h, int64_t nb, const ActRow* act, float (*out)[ROWS],
                     const uint8_t* next) {
  constexpr int64_t kBlock = kMins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  __m256 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = unit + b * kBlock;
    prefetch_lines(next ? next + b * kBlock : nullptr, kBlock);
    __m256i sum16[MT];
    for (int m = 0; m < MT; m++) sum16[m] = _mm256_setzero_si256();
    // Not unrolled: four rows' sums, accumulators and the unpacked nibbles then fit in the 16 registers (unrolled,
    // the compiler hoisted every load and spilled the sums to the stack).
#pragma GCC unroll 1
    for (int p = 0; p < QK / 8; p++) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
      const __m256i low = _mm256_and_si256(packed, nibble);                         // columns 4p .. 4p + 3
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);  // columns 16 + 4p ..
      for (int m = 0; m < MT; m++) {
        const int8_t* a = act[m].q + b * QK + 4 * p;
        sum16[m] = _mm256_add_epi16(sum16[m], _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast_word(a)),
                                                               _mm256_maddubs_epi16(high, broadcast_word(a + QK / 2))));
      }
    }
    const __m256 dw = halves8(reinterpret_cast<const uint16_t*>(wb + Q4_VALUE_BYTES) + ROWS * h);
    for (int m = 0; m < MT; m++) {
      __m256i isum = _mm256_madd_epi16(sum16[m], ones);
      if (!kMins) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * act[m].sum[b]));
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(act[m].d[b])), _mm256_cvtepi32_ps(isum), acc[m]);
      if (kMins) {
        const __m256 mw = halves8(reinterpret_cast<const uint16_t*>(wb + Q4_0_BLOCK_BYTES) + ROWS * h);
        acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(act[m].s[b]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out[m], acc[m]);
}

template <bool kMins>
LK_AVX2 void gemv_q4(const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, const ActRow* act, int64_t M, float* y,
                     int64_t out_features) {
  constexpr int64_t kBlock = kMins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  float tile[MAX_TILE][ROWS];
  for (int64_t u = u0; u < u1; u++) {
    const uint8_t* unit = w + u * nb * kBlock;
    const uint8_t* next = u + 1 < u1 ? unit + nb * kBlock : nullptr;  // asked for with the first rows
    for (int h = 0; h < 2; h++) {  // the second half's bytes are in the cache lines the first half read
      for (int64_t m = 0; m < M; m += MAX_TILE) {
        const int64_t mt = M - m < MAX_TILE ? M - m : MAX_TILE;
        const uint8_t* ahead = h == 0 && m == 0 ? next : nullptr;
        switch (mt) {
          case 1: q4_half<1, kMins>(unit, h, nb, act + m, tile, ahead); break;
          case 2: q4_half<2, kMins>(unit, h, nb, act + m, tile, ahead); break;
          case 3: q4_half<3, kMins>(unit, h, nb, act + m, tile, ahead); break;
          default: q4_half<4, kMins>(unit, h, nb, act + m, tile, ahead); break;
        }
        for (int64_t i = 0; i < mt; i++)
          store_rows(tile[i], ROWS, y + (m + i) * out_features, u * Q4_ROWS + h * ROWS, out_features);
      }
    }
  }
}

template <bool kHalves>
LK_AVX2 void gemv_q8(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, const ActRow* act,
                     int64_t M, float* y, int64_t out_features) {
  float tile[MAX_TILE][ROWS];
  for (int64_t g = g0; g < g1; g++) {
    const int8_t* wg = w + g * nb * Q8_BLOCK_BYTES;
    const uint16_t* sg = scales + g * nb * ROWS * (kHalves ? 2 : 1);
    const int8_t* next = g + 1 < g1 ? wg + nb * Q8_BLOCK_BYTES : nullptr;  // asked for with the first rows
    for (int64_t m = 0; m < M; m += MAX_TILE) {
      const int64_t mt = M - m < MAX_TILE ? M - m : MAX_TILE;
      const int8_t* ahead = m == 0 ? next : nullptr;
      switch (mt) {
        case 1: q8_0_group<1, kHalves>(wg, sg, nb, act + m, tile, ahead); break;
        case 2: q8_0_group<2, kHalves>(wg, sg, nb, act + m, tile, ahead); break;
        case 3: q8_0_group<3, kHalves>(wg, sg, nb, act + m, tile, ahead); break;
        default: q8_0_group<4, kHalves>(wg, sg, nb, act + m, tile, ahead); break;
      }
      for (int64_t i = 0; i < mt; i++) store_rows(tile[i], ROWS, y + (m + i) * out_features, g * ROWS, out_features);
    }
  }
}

}  // namespace

LK_GEMV_Q8_0(gemv_q8_0_avx2) { gemv_q8<false>(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx2) { gemv_q8<true>(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avx2) { gemv_q4<false>(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avx2) { gemv_q4<true>(w, nb, u0, u1, act, M, y, out_features); }

#else
LK_GEMV_Q8_0(gemv_q8_0_avx2) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx2) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avx2) { gemv_q4_0_scalar(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avx2) { gemv_q4_1_scalar(w, nb, u0, u1, act, M, y, out_features); }
#endif

}  // namespace llama_kv
