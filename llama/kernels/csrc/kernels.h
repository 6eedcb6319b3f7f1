// Integer dot-product kernels for block-quantized weights: what every kernel file shares.
//
// Activations are rounded per block of QK values to int8 (Q8_0's rule: d = max|x| / 127, q = round(x / d)),
// weights are int8 blocks (Q8_0: w = d * q) or int4 blocks with a scale and a minimum (Q4_1: w = d * q + m;
// Q4_0 is m = -8d). Each output is then a sum over blocks of float scales times an int32 dot product:
//
//     Q8_0:  y = sum_b (dw_b * da_b) * isum_b                              isum_b = sum_i qw_i * qa_i
//     Q4_1:  y = sum_b (dw_b * da_b) * isum_b  +  sum_b mw_b * sa_b         sa_b = da_b * sum_i qa_i
//
// The int32 sums are exact whatever the order; the float sums run over the blocks in order, one FMA per
// block (fmaf(dw * da, float(isum), acc)), so every instruction path gives the very same bits as the scalar
// loop: each SIMD lane holds one output row and does exactly the scalar loop's operations.
//
// Weights are held interleaved, ROWS rows at a time (a "group"), so that one vector holds 4 columns of each
// of 8 rows and one broadcast activation word meets all of them; no horizontal sums are needed:
//
//     int8:  weight[g][b][j][r][c]   = q[8g + r][32b + 4j + c]      j < 8, r < 8, c < 4   (256 bytes a block)
//     int4:  weight[g][b][p][r][c]   = q[8g + r][32b + 4p + c] | q[8g + r][32b + 16 + 4p + c] << 4   p < 4
//                                                                                           (128 bytes a block)
//     scales[g][b][r], mins[g][b][r] = float16 scale (min) of row 8g + r, block b
//
// Rows past the weight's end (out_features not a multiple of 8) are zeros and never written out.
#pragma once

#include <cstdint>

namespace llama_kv {

constexpr int QK = 32;    // values per block
constexpr int ROWS = 8;   // weight rows interleaved in a group
constexpr int Q8_BLOCK_BYTES = ROWS * QK;      // one group's int8 block
constexpr int Q4_BLOCK_BYTES = ROWS * QK / 2;  // one group's int4 block

// The instruction paths, in order of preference. Which of them this CPU runs is found once, at load.
enum Path : int {
  kScalar = 0,
  kAvx2 = 1,             // AVX2 + FMA + F16C: maddubs (the sign trick keeps it below 16-bit saturation)
  kAvxVnniEmulated = 2,  // the AVX-VNNI code with vpdpbusd written in AVX2: tests the VNNI logic anywhere
  kAvxVnni = 3,          // AVX-VNNI (256-bit vpdpbusd, VEX)
  kAvx512Vnni = 4,       // AVX-512 F/BW/VL + VNNI: 16 rows a vector
  kNumPaths = 5,
};

const char* path_name(int path);
bool cpu_supports(int path);

// Activations of one row: K values -> K / QK blocks of int8 values, scale d, sum of the values, and d * sum.
struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* sum;  // the VNNI paths' int8 kernel takes 128 * sum back off (it multiplies w + 128)
  const float* s;      // d * sum, which the int4 kernel multiplies by each block's minimum
};

void quantize_row_f32(int path, const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s);
void quantize_row_bf16(int path, const uint16_t* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s);

// The products, one function per path and block type: y[m][8 * g + r] for groups g0 <= g < g1, every
// activation row m < M and rows 8g + r below out_features (y's rows are out_features apart).
#define LK_GEMV_Q8_0(name)                                                                                    \
  void name(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, const ActRow* act, \
            int64_t M, float* y, int64_t out_features)
#define LK_GEMV_Q4_1(name)                                                                                  \
  void name(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int64_t nb, int64_t g0, int64_t g1, \
            const ActRow* act, int64_t M, float* y, int64_t out_features)
LK_GEMV_Q8_0(gemv_q8_0_scalar);
LK_GEMV_Q4_1(gemv_q4_1_scalar);
LK_GEMV_Q8_0(gemv_q8_0_avx2);
LK_GEMV_Q4_1(gemv_q4_1_avx2);
LK_GEMV_Q8_0(gemv_q8_0_avxvnni_emulated);
LK_GEMV_Q4_1(gemv_q4_1_avxvnni_emulated);
LK_GEMV_Q8_0(gemv_q8_0_avxvnni);
LK_GEMV_Q4_1(gemv_q4_1_avxvnni);
LK_GEMV_Q8_0(gemv_q8_0_avx512vnni);
LK_GEMV_Q4_1(gemv_q4_1_avx512vnni);

// Up to this many activation rows share each pass over a group's weights.
constexpr int MAX_TILE = 4;

// Write a group's 8 outputs (or 16 for two groups), leaving out rows past the weight's end.
inline void store_rows(const float* acc, int n, float* y, int64_t first_row, int64_t out_features) {
  for (int r = 0; r < n && first_row + r < out_features; r++) y[first_row + r] = acc[r];
}

// The float32 weight of groups g0 <= g < g1 as (rows, K), for the products with many rows.
void dequantize_q8_0(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, float* out);
void dequantize_q4_1(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int64_t nb, int64_t g0,
                     int64_t g1, float* out);

float half_to_float(uint16_t h);

// float32 products of M activation rows x (M, K) with weight rows n0 <= n < n1 of a row-major w (N, K):
// y[m * N + n] (f32_rows.cpp). The AVX-512 path runs where the AVX-512 VNNI one does.
#define LK_F32_ROWS(name) \
  void name(const float* x, int64_t M, const float* w, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N)
LK_F32_ROWS(f32_rows_scalar);
LK_F32_ROWS(f32_rows_avx2);
LK_F32_ROWS(f32_rows_avx512);

}  // namespace llama_kv

// Function-level targets: one build serves every x86 CPU, each path called only where the CPU has it.
#if defined(__x86_64__) || defined(_M_X64)
#define LLAMA_KV_X86 1
#include <immintrin.h>
#define LK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LK_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define LK_AVX512VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define LK_AVX512F __attribute__((target("avx2,fma,f16c,avx512f")))
#else
#define LLAMA_KV_X86 0
#endif
