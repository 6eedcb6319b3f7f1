// Integer dot-product kernels for block-quantized weights: what every kernel file shares.
//
// Activations are rounded per block of QK values to int8 (Q8_0's rule: d = max|x| / 127, q = round(x / d)),
// weights are int8 blocks (Q8_0: w = d * q), int4 blocks with a scale (Q4_0: w = d * (q - 8)) or int4 blocks
// with a scale and a minimum (Q4_1: w = d * q + m). Each output is then a sum over blocks of float scales
// times an int32 dot product:
//
//     Q8_0:  y = sum_b (dw_b * da_b) * isum_b                              isum_b = sum_i qw_i * qa_i
//     Q4_0:  y = sum_b (dw_b * da_b) * (isum_b - 8 * asum_b)               asum_b = sum_i qa_i
//     Q4_1:  y = sum_b (dw_b * da_b) * isum_b  +  sum_b mw_b * sa_b         sa_b = da_b * asum_b
//
// The int32 sums are exact whatever the order; the float sums run over the blocks in order, one FMA per
// block (fmaf(dw * da, float(isum), acc)), so every instruction path gives the very same bits as the scalar
// loop: each SIMD lane holds one output row and does exactly the scalar loop's operations.
//
// Weights are held interleaved, so that one vector holds 4 columns of each of 8 rows and one broadcast
// activation word meets all of them; no horizontal sums are needed. int8 goes ROWS = 8 rows at a time (a
// "group"); int4 Q4_ROWS = 16 rows at a time (a "unit", two halves of 8), its scales (and minimums) in the
// same run of bytes as its values, so that a thread reads one stream and AVX-512 a whole unit per load:
//
//     int8:  weight[g][b][j][r][c]   = q[8g + r][32b + 4j + c]      j < 8, r < 8, c < 4   (256 bytes a block)
//            scales[g][b][r]         = float16 scale of row 8g + r, block b
//            (in groups of 16, a GGUF's Q6_K: scales[g][b][half][r], half 0 for columns 0-15 of the block,
//             each half's products scaled apart: y = sum_b sum_half (dw * da) * isum_half)
//     int4:  unit u, block b, 288 bytes (Q4_0) or 320 (Q4_1), row R = 16u + 8h + r:
//            bytes 64p + 32h + 4r + c = q[R][32b + 4p + c] | q[R][32b + 16 + 4p + c] << 4    p < 4, h < 2
//            bytes 256 + 2(8h + r)    = float16 scale of row R, block b
//            bytes 288 + 2(8h + r)    = float16 minimum of row R, block b (Q4_1 only)
//
// Rows past the weight's end (out_features not a multiple of 8, or 16) are zeros and never written out.
#pragma once

#include <cstdint>

// The library is built with hidden symbols and loaded RTLD_GLOBAL (for the C entry points compiled steps call):
// only what is marked so is seen from outside it.
#define LLAMA_KV_EXPORT __attribute__((visibility("default")))

// In those entry points (the ends of ops.cpp and attention.cpp, which include torch's aoti_torch/utils.h): the
// tensor behind a handle, and `*out` set to a new handle on `call`'s result, an exception becoming AOTInductor's
// error code with its message kept for the caller.
#define LLAMA_KV_TENSOR(h) (*torch::aot_inductor::tensor_handle_to_tensor_pointer(h))
#define LLAMA_KV_SHIM(call) \
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *out = torch::aot_inductor::new_tensor_handle(call); })

namespace llama_kv {

constexpr int QK = 32;    // values per block
constexpr int ROWS = 8;   // weight rows interleaved in a group
constexpr int Q8_BLOCK_BYTES = ROWS * QK;      // one group's int8 block
constexpr int Q4_ROWS = 16;                   // int4 weight rows interleaved in a unit
constexpr int Q4_VALUE_BYTES = Q4_ROWS * QK / 2;            // one unit's int4 values of a block
constexpr int Q4_0_BLOCK_BYTES = Q4_VALUE_BYTES + 2 * Q4_ROWS;  // ... and their float16 scales
constexpr int Q4_1_BLOCK_BYTES = Q4_0_BLOCK_BYTES + 2 * Q4_ROWS;  // ... and their float16 minimums

// The instruction paths, in order of preference. Which of them this CPU runs is found once, at load.
enum Path : int {
  kScalar = 0,
  kAvx2 = 1,             // AVX2 + FMA + F16C: maddubs (the sign trick keeps it below 16-bit saturation)
  kAvxVnniEmulated = 2,  // the AVX-VNNI code with vpdpbusd written in AVX2: tests the VNNI logic anywhere
  kAvxVnni = 3,          // AVX-VNNI (256-bit vpdpbusd, VEX)
  kAvx512 = 4,           // AVX-512 F/BW/VL without VNNI: maddubs, 16 rows a vector
  kAvx512Vnni = 5,       // AVX-512 F/BW/VL + VNNI: vpdpbusd, 16 rows a vector
  kAmx = 6,              // AVX-512 VNNI, and AMX tiles for products of 16 rows and more (dot_amx.cpp)
  kNumPaths = 7,
};

const char* path_name(int path);
bool cpu_supports(int path);
int kernel_path();  // the path the ops take now: the CPU's best, or the one forced (tests force each)

// Activations of one row: K values -> K / QK blocks of int8 values, scale d, sum of the values, and d * sum.
struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* sum;  // Q4_0 takes 8 * sum off; the VNNI paths' int8 kernel 128 * sum (it multiplies w + 128)
  const float* s;      // d * sum, which the Q4_1 kernel multiplies by each block's minimum
  const int32_t* sum16;  // the sum of each block's first 16 values: the groups-of-16 kernel's VNNI correction
};

void quantize_row_f32(int path, const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s);
void quantize_row_bf16(int path, const uint16_t* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* s);

// The products, one function per path and block type: y[m][R] for every activation row m < M and weight rows
// R below out_features of groups g0 <= g < g1 (int8) or units u0 <= u < u1 (int4); y's rows are out_features
// apart.
#define LK_GEMV_Q8_0(name)                                                                                    \
  void name(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, const ActRow* act, \
            int64_t M, float* y, int64_t out_features)
#define LK_GEMV_Q4(name) \
  void name(const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, const ActRow* act, int64_t M, float* y, int64_t out_features)
LK_GEMV_Q8_0(gemv_q8_0_scalar);
LK_GEMV_Q8_0(gemv_q8_0_avx2);
LK_GEMV_Q8_0(gemv_q8_0_avxvnni_emulated);
LK_GEMV_Q8_0(gemv_q8_0_avxvnni);
LK_GEMV_Q8_0(gemv_q8_0_avx512);
LK_GEMV_Q8_0(gemv_q8_0_avx512vnni);
// int8 in groups of 16 (two scales a block, scales[g][b][half][r]): the same signature.
LK_GEMV_Q8_0(gemv_q8_16_scalar);
LK_GEMV_Q8_0(gemv_q8_16_avx2);
LK_GEMV_Q8_0(gemv_q8_16_avxvnni_emulated);
LK_GEMV_Q8_0(gemv_q8_16_avxvnni);
LK_GEMV_Q8_0(gemv_q8_16_avx512);
LK_GEMV_Q8_0(gemv_q8_16_avx512vnni);
// Q8_0, Q4_0 and Q4_1 products of M rows, M a multiple of 16, on AMX tiles; only where cpu_runs_amx().
LK_GEMV_Q8_0(gemm_q8_0_amx);
LK_GEMV_Q4(gemm_q4_0_amx);
LK_GEMV_Q4(gemm_q4_1_amx);
bool cpu_runs_amx();
#define LK_DECLARE_Q4(path) LK_GEMV_Q4(gemv_q4_0_##path); LK_GEMV_Q4(gemv_q4_1_##path);
LK_DECLARE_Q4(scalar)
LK_DECLARE_Q4(avx2)
LK_DECLARE_Q4(avxvnni_emulated)
LK_DECLARE_Q4(avxvnni)
LK_DECLARE_Q4(avx512)
LK_DECLARE_Q4(avx512vnni)
#undef LK_DECLARE_Q4

// Up to this many activation rows share each pass over a group's weights.
constexpr int MAX_TILE = 4;

// Asks for every cache line of the `bytes` at p (nothing, if p is null) to be brought into the caches, without
// waiting. The products call it at each block they multiply with the same block of the weights they multiply next:
// a thread reading weights from memory with nothing asked ahead waits on each line in turn (docs/benchmarks.md,
// "Figures behind the code"); the attention, with the next block of keys and values.
inline void prefetch_lines(const void* p, int64_t bytes) {
  if (!p) return;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63); line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}

// Write a group's 8 outputs (or a unit's 16), leaving out rows past the weight's end.
inline void store_rows(const float* acc, int n, float* y, int64_t first_row, int64_t out_features) {
  for (int r = 0; r < n && first_row + r < out_features; r++) y[first_row + r] = acc[r];
}

// The float32 weight of groups g0 <= g < g1 (units u0 <= u < u1) as (rows, K), for the products with many rows.
void dequantize_q8_0(bool halves, const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1, float* out);
void dequantize_q4(bool has_mins, const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, float* out);

float half_to_float(uint16_t h);

// float32 products of M activation rows x (M, K) with weight rows n0 <= n < n1 of a row-major w (N, K):
// y[m * N + n] (f32_rows.cpp). The AVX-512 path runs on both AVX-512 paths.
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
#define LK_AVX512BW __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define LK_AVX512VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define LK_AVX512F __attribute__((target("avx2,fma,f16c,avx512f")))
#else
#define LLAMA_KV_X86 0
#endif
