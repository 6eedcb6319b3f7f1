// AVX-512 block products, 16 weight rows per 512-bit vector (two int8 groups, or one int4 unit in one load):
// with vpdpbusd where the CPU has AVX-512 VNNI, and with maddubs where it has AVX-512 BW alone (Skylake-SP
// and the other Xeons before Cascade Lake). One body, avx512.inc, compiled for each.
#include <cstring>

#include "kernels.h"

namespace llama_kv {

#if LLAMA_KV_X86

namespace vnni {
// vpdpbusd multiplies unsigned bytes by signed ones: int8 weights go in as w + 128 (w xor 0x80, 0..255), and
// 128 * the activations' sum comes back off (|sum (w + 128) a| <= 255 * 127 * 32, far from int32's limits).
constexpr int32_t kQ8Bias = 128;

LK_AVX512VNNI inline __m512i q8_add(__m512i acc, __m512i w, int32_t word) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), _mm512_set1_epi32(word));
}

LK_AVX512VNNI inline __m512i q4_add(__m512i acc, __m512i u, int32_t word) {
  return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(word));
}

LK_AVX512VNNI inline __m512i q4_total(__m512i lo, __m512i hi) { return _mm512_add_epi32(lo, hi); }

#define LK_TARGET LK_AVX512VNNI
#include "avx512.inc"
#undef LK_TARGET
}  // namespace vnni

namespace bw {
// maddubs multiplies unsigned by signed bytes and adds pairs into int16, saturating: int8 weights go in as |w|
// against the activations with w's sign, a pair at most 2 * 128 * 127 = 32512 (dot_avx2.cpp's sign trick; AVX-512
// has no sign_epi8, so the activations are negated where w < 0 under a mask). Nothing to take back off.
constexpr int32_t kQ8Bias = 0;

LK_AVX512BW inline __m512i q8_add(__m512i acc, __m512i w, int32_t word) {
  const __m512i a = _mm512_set1_epi32(word);
  const __m512i signed_a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_a);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}

// int4 values are 0..15: a pair is at most 2 * 15 * 127 = 3810, so a block's two chains of four stay in int16
// (8 * 3810 = 30480 together) and widen once, in q4_total.
LK_AVX512BW inline __m512i q4_add(__m512i acc, __m512i u, int32_t word) {
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, _mm512_set1_epi32(word)));
}

LK_AVX512BW inline __m512i q4_total(__m512i lo, __m512i hi) {
  return _mm512_madd_epi16(_mm512_add_epi16(lo, hi), _mm512_set1_epi16(1));
}

#define LK_TARGET LK_AVX512BW
#include "avx512.inc"
#undef LK_TARGET
}  // namespace bw

LK_GEMV_Q8_0(gemv_q8_0_avx512vnni) { vnni::gemv_q8_0(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx512vnni) { vnni::gemv_q8_16(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avx512vnni) { vnni::gemv_q4_0(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avx512vnni) { vnni::gemv_q4_1(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_0_avx512) { bw::gemv_q8_0(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avx512) { bw::gemv_q8_16(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_0_avx512) { bw::gemv_q4_0(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_avx512) { bw::gemv_q4_1(w, nb, u0, u1, act, M, y, out_features); }

#else
#define LK_SCALAR_PATH(path)                                                                                          \
  LK_GEMV_Q8_0(gemv_q8_0_##path) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }              \
  LK_GEMV_Q8_0(gemv_q8_16_##path) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }            \
  LK_GEMV_Q4(gemv_q4_0_##path) { gemv_q4_0_scalar(w, nb, u0, u1, act, M, y, out_features); }                        \
  LK_GEMV_Q4(gemv_q4_1_##path) { gemv_q4_1_scalar(w, nb, u0, u1, act, M, y, out_features); }
LK_SCALAR_PATH(avx512vnni)
LK_SCALAR_PATH(avx512)
#undef LK_SCALAR_PATH
#endif

}  // namespace llama_kv
