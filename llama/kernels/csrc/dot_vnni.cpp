// VNNI block products (vpdpbusd: four u8 x s8 products into each int32 lane): AVX-VNNI at 256 bits, the same
// code with vpdpbusd emulated in AVX2 (a test path), and AVX-512 VNNI, which takes 16 rows per 512-bit vector
// (two int8 groups, or one int4 unit in one load). Each lane holds one weight row and does the scalar loop's
// operations in its order.
#include <cstring>

#include "kernels.h"

namespace llama_kv {

#if LLAMA_KV_X86

// vpdpbusd in AVX2: bytes widened to 16 bits (u zero-extended, s sign-extended), even and odd bytes apart,
// multiplied and added in pairs by madd_epi16 (products of at most 255 * 128 fit its int16 x int16 -> int32).
LK_AVX2 inline __m256i dpbusd_avx2(__m256i acc, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF));
  const __m256i u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
  const __m256i s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}

namespace emulated {
#define LK_TARGET LK_AVX2
#define LK_DPBUSD(acc, u, s) dpbusd_avx2(acc, u, s)
#define LK_Q8_GROUP q8_0_group
#define LK_Q4_HALF q4_half
#define LK_Q4_UNITS q4_units
#define LK_Q8_GROUPS q8_groups
#define LK_Q8_GEMV gemv_q8_0
#define LK_Q8_16_GEMV gemv_q8_16
#define LK_Q4_0_GEMV gemv_q4_0
#define LK_Q4_1_GEMV gemv_q4_1
#include "vnni256.inc"
#undef LK_TARGET
#undef LK_DPBUSD
#undef LK_Q8_GROUP
#undef LK_Q4_HALF
#undef LK_Q4_UNITS
#undef LK_Q8_GROUPS
#undef LK_Q8_GEMV
#undef LK_Q8_16_GEMV
#undef LK_Q4_0_GEMV
#undef LK_Q4_1_GEMV
}  // namespace emulated

namespace avxvnni {
#define LK_TARGET LK_AVXVNNI
#define LK_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define LK_Q8_GROUP q8_0_group
#define LK_Q4_HALF q4_half
#define LK_Q4_UNITS q4_units
#define LK_Q8_GROUPS q8_groups
#define LK_Q8_GEMV gemv_q8_0
#define LK_Q8_16_GEMV gemv_q8_16
#define LK_Q4_0_GEMV gemv_q4_0
#define LK_Q4_1_GEMV gemv_q4_1
#include "vnni256.inc"
#undef LK_TARGET
#undef LK_DPBUSD
#undef LK_Q8_GROUP
#undef LK_Q4_HALF
#undef LK_Q4_UNITS
#undef LK_Q8_GROUPS
#undef LK_Q8_GEMV
#undef LK_Q8_16_GEMV
#undef LK_Q4_0_GEMV
#undef LK_Q4_1_GEMV
}  // namespace avxvnni

LK_GEMV_Q8_0(gemv_q8_0_avxvnni_emulated) { emulated::gemv_q8_0(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni_emulated) { emulated::gemv_q8_16(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avxvnni_emulated) { emulated::gemv_q4_0(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avxvnni_emulated) { emulated::gemv_q4_1(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_0_avxvnni) { avxvnni::gemv_q8_0(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni) { avxvnni::gemv_q8_16(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avxvnni) { avxvnni::gemv_q4_0(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avxvnni) { avxvnni::gemv_q4_1(w, nb, u0, u1, act, M, y, out_features); }

// AVX-512: lanes 0-7 are the rows of group g, lanes 8-15 those of group g + 1 (zeros past the last group).
namespace {

LK_AVX512VNNI inline __m512i two_groups(const void* first, const void* second) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m256i hi = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

LK_AVX512VNNI inline __m512 two_groups_halves(const uint16_t* first, const uint16_t* second) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first));
  const __m128i hi = second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// kHalves: int8 in groups of 16 (scales[g][b][half][r]), each half of a block scaled apart, with its own
// correction of 128 * the half's sum of activations.
template <int MT, bool kHalves>
LK_AVX512VNNI void q8_0_pair(const int8_t* w0, const int8_t* w1, const uint16_t* s0, const uint16_t* s1, int64_t nb,
                             const ActRow* act, float (*out)[2 * ROWS]) {
  __m512 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; b++) {
    const int64_t at = b * Q8_BLOCK_BYTES;
    // Two chains of vpdpbusd, columns 0-15 (runs 0-3) and 16-31 (runs 4-7): one waits on its latency at one row.
    __m512i lo[MT], hi[MT];
    for (int m = 0; m < MT; m++) lo[m] = hi[m] = _mm512_setzero_si512();
    for (int j = 0; j < QK / 8; j++) {
      const __m512i u = _mm512_xor_si512(two_groups(w0 + at + 32 * j, w1 ? w1 + at + 32 * j : nullptr), flip);
      const __m512i u1 = _mm512_xor_si512(two_groups(w0 + at + 32 * j + 128, w1 ? w1 + at + 32 * j + 128 : nullptr), flip);
      for (int m = 0; m < MT; m++) {
        int32_t word, word1;
        std::memcpy(&word, act[m].q + b * QK + 4 * j, 4);
        std::memcpy(&word1, act[m].q + b * QK + 4 * j + QK / 2, 4);
        lo[m] = _mm512_dpbusd_epi32(lo[m], u, _mm512_set1_epi32(word));
        hi[m] = _mm512_dpbusd_epi32(hi[m], u1, _mm512_set1_epi32(word1));
      }
    }
    if (kHalves) {
      for (int h = 0; h < 2; h++) {
        const __m512 dw = two_groups_halves(s0 + (2 * b + h) * ROWS, s1 ? s1 + (2 * b + h) * ROWS : nullptr);
        for (int m = 0; m < MT; m++) {
          const int32_t half_sum = h == 0 ? act[m].sum16[b] : act[m].sum[b] - act[m].sum16[b];
          const __m512i exact = _mm512_sub_epi32(h == 0 ? lo[m] : hi[m], _mm512_set1_epi32(128 * half_sum));
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(act[m].d[b])), _mm512_cvtepi32_ps(exact), acc[m]);
        }
      }
    } else {
      const __m512 dw = two_groups_halves(s0 + b * ROWS, s1 ? s1 + b * ROWS : nullptr);
      for (int m = 0; m < MT; m++) {
        const __m512i total = _mm512_add_epi32(lo[m], hi[m]);  // integers: the same sum in any order
        const __m512i exact = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * act[m].sum[b]));
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(act[m].d[b])), _mm512_cvtepi32_ps(exact), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(out[m], acc[m]);
}

// A whole int4 unit (16 rows) per vector: each 64-byte run is one load, the scales (and minimums) 32 bytes after
// the values in the same stream.
template <int MT, bool kMins>
LK_AVX512VNNI void q4_unit(const uint8_t* unit, int64_t nb, const ActRow* act, float (*out)[Q4_ROWS]) {
  constexpr int64_t kBlock = kMins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  __m512 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = unit + b * kBlock;
    __m512i isum[MT], hsum[MT];  // low and high nibbles in two chains of vpdpbusd, not one waiting on its latency
    for (int m = 0; m < MT; m++) isum[m] = hsum[m] = _mm512_setzero_si512();
    for (int p = 0; p < QK / 8; p++) {
      const __m512i packed = _mm512_loadu_si512(wb + 64 * p);
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int m = 0; m < MT; m++) {
        int32_t lo_word, hi_word;
        std::memcpy(&lo_word, act[m].q + b * QK + 4 * p, 4);
        std::memcpy(&hi_word, act[m].q + b * QK + QK / 2 + 4 * p, 4);
        isum[m] = _mm512_dpbusd_epi32(isum[m], low, _mm512_set1_epi32(lo_word));
        hsum[m] = _mm512_dpbusd_epi32(hsum[m], high, _mm512_set1_epi32(hi_word));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + Q4_VALUE_BYTES)));
    for (int m = 0; m < MT; m++) {
      __m512i total = _mm512_add_epi32(isum[m], hsum[m]);  // integers: the same sum in any order
      if (!kMins) total = _mm512_sub_epi32(total, _mm512_set1_epi32(8 * act[m].sum[b]));
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(act[m].d[b])), _mm512_cvtepi32_ps(total), acc[m]);
      if (kMins) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + Q4_0_BLOCK_BYTES)));
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(act[m].s[b]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(out[m], acc[m]);
}

template <bool kMins>
LK_AVX512VNNI void gemv_q4(const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, const ActRow* act, int64_t M,
                           float* y, int64_t out_features) {
  constexpr int64_t kBlock = kMins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  float tile[MAX_TILE][Q4_ROWS];
  for (int64_t u = u0; u < u1; u++) {
    const uint8_t* unit = w + u * nb * kBlock;
    for (int64_t m = 0; m < M; m += MAX_TILE) {
      const int64_t mt = M - m < MAX_TILE ? M - m : MAX_TILE;
      switch (mt) {
        case 1: q4_unit<1, kMins>(unit, nb, act + m, tile); break;
        case 2: q4_unit<2, kMins>(unit, nb, act + m, tile); break;
        case 3: q4_unit<3, kMins>(unit, nb, act + m, tile); break;
        default: q4_unit<4, kMins>(unit, nb, act + m, tile); break;
      }
      for (int64_t i = 0; i < mt; i++) store_rows(tile[i], Q4_ROWS, y + (m + i) * out_features, u * Q4_ROWS, out_features);
    }
  }
}

}  // namespace

template <bool kHalves>
LK_AVX512VNNI void gemv_q8(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1,
                           const ActRow* act, int64_t M, float* y, int64_t out_features) {
  const int64_t group_scales = nb * ROWS * (kHalves ? 2 : 1);
  float tile[MAX_TILE][2 * ROWS];
  for (int64_t g = g0; g < g1; g += 2) {
    const bool pair = g + 1 < g1;
    const int8_t* w0 = w + g * nb * Q8_BLOCK_BYTES;
    const int8_t* w1 = pair ? w0 + nb * Q8_BLOCK_BYTES : nullptr;
    const uint16_t* s0 = scales + g * group_scales;
    const uint16_t* s1 = pair ? s0 + group_scales : nullptr;
    for (int64_t m = 0; m < M; m += MAX_TILE) {
      const int64_t mt = M - m < MAX_TILE ? M - m : MAX_TILE;
      switch (mt) {
        case 1: q8_0_pair<1, kHalves>(w0, w1, s0, s1, nb, act + m, tile); break;
        case 2: q8_0_pair<2, kHalves>(w0, w1, s0, s1, nb, act + m, tile); break;
        case 3: q8_0_pair<3, kHalves>(w0, w1, s0, s1, nb, act + m, tile); break;
        default: q8_0_pair<4, kHalves>(w0, w1, s0, s1, nb, act + m, tile); break;
      }
      for (int64_t i = 0; i < mt; i++)
        store_rows(tile[i], pair ? 2 * ROWS : ROWS, y + (m + i) * out_features, g * ROWS, out_features);
    }
  }
}

LK_GEMV_Q8_0(gemv_q8_0_avx512vnni) { gemv_q8<false>(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx512vnni) { gemv_q8<true>(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avx512vnni) { gemv_q4<false>(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avx512vnni) { gemv_q4<true>(w, nb, u0, u1, act, M, y, out_features); }

#else
LK_GEMV_Q8_0(gemv_q8_0_avxvnni_emulated) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_0_avxvnni) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_0_avx512vnni) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni_emulated) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx512vnni) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
#define LK_SCALAR_Q4(path)                                                                                   \
  LK_GEMV_Q4(gemv_q4_0_##path) { gemv_q4_0_scalar(w, nb, u0, u1, act, M, y, out_features); } \
  LK_GEMV_Q4(gemv_q4_1_##path) { gemv_q4_1_scalar(w, nb, u0, u1, act, M, y, out_features); }
LK_SCALAR_Q4(avxvnni_emulated)
LK_SCALAR_Q4(avxvnni)
LK_SCALAR_Q4(avx512vnni)
#undef LK_SCALAR_Q4
#endif

}  // namespace llama_kv
