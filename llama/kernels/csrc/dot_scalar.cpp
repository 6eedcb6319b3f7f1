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

LK_GEMV_Q8_0(gemv_q8_0_scalar) {
  for (int64_t g = g0; g < g1; g++) {
    for (int64_t m = 0; m < M; m++) {
      float acc[ROWS] = {};
      for (int64_t b = 0; b < nb; b++) {
        const int8_t* wb = w + (g * nb + b) * Q8_BLOCK_BYTES;
        const int8_t* a = act[m].q + b * QK;
        for (int r = 0; r < ROWS; r++) {
          int32_t isum = 0;
          for (int j = 0; j < QK / 4; j++)
            for (int c = 0; c < 4; c++) isum += int32_t(wb[(j * ROWS + r) * 4 + c]) * a[4 * j + c];
          const float scale = half_to_float(scales[(g * nb + b) * ROWS + r]) * act[m].d[b];
          acc[r] = std::fma(scale, float(isum), acc[r]);
        }
      }
      store_rows(acc, ROWS, y + m * out_features, g * ROWS, out_features);
    }
  }
}

LK_GEMV_Q4_1(gemv_q4_1_scalar) {
  for (int64_t g = g0; g < g1; g++) {
    for (int64_t m = 0; m < M; m++) {
      float acc[ROWS] = {};
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* wb = w + (g * nb + b) * Q4_BLOCK_BYTES;
        const int8_t* a = act[m].q + b * QK;
        for (int r = 0; r < ROWS; r++) {
          int32_t isum = 0;
          for (int p = 0; p < QK / 8; p++)
            for (int c = 0; c < 4; c++) {
              const uint8_t byte = wb[(p * ROWS + r) * 4 + c];
              isum += int32_t(byte & 0x0F) * a[4 * p + c] + int32_t(byte >> 4) * a[QK / 2 + 4 * p + c];
            }
          const int64_t k = (g * nb + b) * ROWS + r;
          acc[r] = std::fma(half_to_float(scales[k]) * act[m].d[b], float(isum), acc[r]);
          acc[r] = std::fma(half_to_float(mins[k]), act[m].s[b], acc[r]);
        }
      }
      store_rows(acc, ROWS, y + m * out_features, g * ROWS, out_features);
    }
  }
}

void dequantize_q8_0(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, float* out) {
  const int64_t K = nb * QK;
  for (int64_t g = g0; g < g1; g++)
    for (int64_t b = 0; b < nb; b++)
      for (int r = 0; r < ROWS; r++) {
        const float d = half_to_float(scales[(g * nb + b) * ROWS + r]);
        float* row = out + ((g - g0) * ROWS + r) * K + b * QK;
        for (int j = 0; j < QK / 4; j++)
          for (int c = 0; c < 4; c++) row[4 * j + c] = float(w[((g * nb + b) * QK / 4 + j) * ROWS * 4 + r * 4 + c]) * d;
      }
}

void dequantize_q4_1(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int64_t nb, int64_t g0,
                     int64_t g1, float* out) {
  const int64_t K = nb * QK;
  for (int64_t g = g0; g < g1; g++)
    for (int64_t b = 0; b < nb; b++)
      for (int r = 0; r < ROWS; r++) {
        const int64_t k = (g * nb + b) * ROWS + r;
        const float d = half_to_float(scales[k]), m = half_to_float(mins[k]);
        float* row = out + ((g - g0) * ROWS + r) * K + b * QK;
        const uint8_t* wb = w + (g * nb + b) * Q4_BLOCK_BYTES;
        for (int p = 0; p < QK / 8; p++)
          for (int c = 0; c < 4; c++) {
            const uint8_t byte = wb[(p * ROWS + r) * 4 + c];
            row[4 * p + c] = float(byte & 0x0F) * d + m;
            row[QK / 2 + 4 * p + c] = float(byte >> 4) * d + m;
          }
      }
}

}  // namespace llama_kv
