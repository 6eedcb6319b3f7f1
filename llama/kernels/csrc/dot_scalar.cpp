// The plain loops every SIMD path must equal, bit for bit: int8 x int8 and int4 x int8 block products, and
// the weights dequantized to float32 for the products with many rows.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace llama_kv {

float half_to_float(uint16_t h) {
  // IEEE binary16 -> binary32, exactly (every float16 is a float32).
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);  // infinity or NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      exponent--;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

// Scale of row r of group g, block b (and half h, in groups of 16).
inline float q8_scale(const uint16_t* scales, int64_t nb, int64_t g, int64_t b, int h, int r, bool halves) {
  return half_to_float(scales[((g * nb + b) * (halves ? 2 : 1) + h) * ROWS + r]);
}

template <bool kHalves>
void gemv_q8(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, const ActRow* act,
             int64_t M, float* y, int64_t out_features) {
  for (int64_t g = g0; g < g1; g++) {
    for (int64_t m = 0; m < M; m++) {
      float acc[ROWS] = {};
      for (int64_t b = 0; b < nb; b++) {
        const int8_t* wb = w + (g * nb + b) * Q8_BLOCK_BYTES;
        const int8_t* a = act[m].q + b * QK;
        for (int r = 0; r < ROWS; r++) {
          int32_t isum[2] = {};  // columns 0-15 and 16-31
          for (int j = 0; j < QK / 4; j++)
            for (int c = 0; c < 4; c++) isum[j / 4] += int32_t(wb[(j * ROWS + r) * 4 + c]) * a[4 * j + c];
          if (kHalves) {
            for (int h = 0; h < 2; h++)
              acc[r] = std::fma(q8_scale(scales, nb, g, b, h, r, true) * act[m].d[b], float(isum[h]), acc[r]);
          } else {
            acc[r] = std::fma(q8_scale(scales, nb, g, b, 0, r, false) * act[m].d[b], float(isum[0] + isum[1]), acc[r]);
          }
        }
      }
      store_rows(acc, ROWS, y + m * out_features, g * ROWS, out_features);
    }
  }
}

}  // namespace

LK_GEMV_Q8_0(gemv_q8_0_scalar) { gemv_q8<false>(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q8_0(gemv_q8_16_scalar) { gemv_q8<true>(w, scales, nb, g0, g1, act, M, y, out_features); }

namespace {

// Unit u's block b: its values, and row i's (i = 8h + r) scale and minimum.
inline const uint8_t* q4_block(const uint8_t* w, int64_t nb, int64_t u, int64_t b, bool has_mins) {
  return w + (u * nb + b) * (has_mins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES);
}

inline float q4_scale(const uint8_t* block, int i) {
  uint16_t h;
  std::memcpy(&h, block + Q4_VALUE_BYTES + 2 * i, 2);
  return half_to_float(h);
}

inline float q4_min(const uint8_t* block, int i) { return q4_scale(block + 2 * Q4_ROWS, i); }

// Row i of a unit's block: value k (0..31) of the row.
inline int32_t q4_value(const uint8_t* block, int i, int k) {
  const int h = i / ROWS, r = i % ROWS, p = (k % (QK / 2)) / 4, c = k % 4;
  const uint8_t byte = block[64 * p + 32 * h + 4 * r + c];
  return k < QK / 2 ? byte & 0x0F : byte >> 4;
}

template <bool kMins>
void gemv_q4(const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, const ActRow* act, int64_t M, float* y,
             int64_t out_features) {
  for (int64_t u = u0; u < u1; u++) {
    for (int64_t m = 0; m < M; m++) {
      float acc[Q4_ROWS] = {};
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* block = q4_block(w, nb, u, b, kMins);
        const int8_t* a = act[m].q + b * QK;
        for (int i = 0; i < Q4_ROWS; i++) {
          int32_t isum = 0;
          for (int k = 0; k < QK; k++) isum += q4_value(block, i, k) * a[k];
          const float scale = q4_scale(block, i) * act[m].d[b];
          if (kMins) {
            acc[i] = std::fma(scale, float(isum), acc[i]);
            acc[i] = std::fma(q4_min(block, i), act[m].s[b], acc[i]);
          } else {
            acc[i] = std::fma(scale, float(isum - 8 * act[m].sum[b]), acc[i]);
          }
        }
      }
      store_rows(acc, Q4_ROWS, y + m * out_features, u * Q4_ROWS, out_features);
    }
  }
}

}  // namespace

LK_GEMV_Q4(gemv_q4_0_scalar) { gemv_q4<false>(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemv_q4_1_scalar) { gemv_q4<true>(w, nb, u0, u1, act, M, y, out_features); }

void dequantize_q8_0(bool halves, const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, float* out) {
  const int64_t K = nb * QK;
  for (int64_t g = g0; g < g1; g++)
    for (int64_t b = 0; b < nb; b++)
      for (int r = 0; r < ROWS; r++) {
        float* row = out + ((g - g0) * ROWS + r) * K + b * QK;
        for (int j = 0; j < QK / 4; j++) {
          const float d = q8_scale(scales, nb, g, b, halves ? j / 4 : 0, r, halves);
          for (int c = 0; c < 4; c++) row[4 * j + c] = float(w[((g * nb + b) * QK / 4 + j) * ROWS * 4 + r * 4 + c]) * d;
        }
      }
}

void dequantize_q4(bool has_mins, const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, float* out) {
  const int64_t K = nb * QK;
  for (int64_t u = u0; u < u1; u++)
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* block = q4_block(w, nb, u, b, has_mins);
      for (int i = 0; i < Q4_ROWS; i++) {
        const float d = q4_scale(block, i), m = has_mins ? q4_min(block, i) : -8 * d;
        float* row = out + ((u - u0) * Q4_ROWS + i) * K + b * QK;
        for (int k = 0; k < QK; k++) row[k] = float(q4_value(block, i, k)) * d + m;
      }
    }
}

}  // namespace llama_kv
