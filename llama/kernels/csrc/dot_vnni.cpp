// 256-bit VNNI block products (vpdpbusd: four u8 x s8 products into each int32 lane): AVX-VNNI, and the same
// code with vpdpbusd emulated in AVX2 (a test path). Each lane holds one weight row and does the scalar loop's
// operations in its order. The 512-bit ones are in dot_avx512.cpp.
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

#else
LK_GEMV_Q8_0(gemv_q8_0_avxvnni_emulated) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_0_avxvnni) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni_emulated) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_avxvnni) { gemv_q8_16_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
#define LK_SCALAR_Q4(path)                                                                                   \
  LK_GEMV_Q4(gemv_q4_0_##path) { gemv_q4_0_scalar(w, nb, u0, u1, act, M, y, out_features); } \
  LK_GEMV_Q4(gemv_q4_1_##path) { gemv_q4_1_scalar(w, nb, u0, u1, act, M, y, out_features); }
LK_SCALAR_Q4(avxvnni_emulated)
LK_SCALAR_Q4(avxvnni)
#undef LK_SCALAR_Q4
#endif

}  // namespace llama_kv
