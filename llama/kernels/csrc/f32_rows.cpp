// float32 products of activation rows with a row-major weight: y[m][n] = sum_k x[m][k] * w[n][k].
//
// Decoding multiplies one row per sequence (a few, for a batch) by every weight matrix, so the work is reading
// the weights once. Here each weight row, read once, meets every activation row, the activations staying in
// L1; a matrix library's GEMM, tuned for many rows, reads the weights again for each tile of them. A prompt's
// rows (past PAIR_BYTES) go in blocks that stay in L2, three weight rows a pass on AVX2, four on AVX-512: on the
// default model's shapes, 64 to 2,048 rows took 0.80 to 1.12 times MKL's time on the 2-core AVX2 EPYC, one weight
// row a pass 1.45 to 2.36 times.
//
// Each output is one dot product computed the same way whatever else is computed with it: the same vector
// width, the same order of products and additions, the same final sum of lanes. So a row's outputs do not
// depend on how many rows come with it or how the work is split over threads; they do depend on the
// instruction path (vector width), as any change of summation order does.
#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace llama_kv {

namespace {

// How far ahead in the weights each step asks for them: into L1 for the next few rows, and into L2 further on,
// which keeps enough of the stream in flight to cover memory's latency while the rows are multiplied. The L2
// request 16 KB ahead took the default model's matrices from 30.1 to 21.4 ms at 8 rows and from 19.5 to
// 17.2 ms at 2 rows (4 KB into L1 alone did nothing). Prefetches past the end of the weights never fault.
constexpr int PREFETCH = 2048;
constexpr int PREFETCH_L2 = 16384;
// Activations of more bytes than this (an L1 data cache) meet several weight rows a pass, so that they stream
// through the core as many times fewer (one row a pass was as fast or faster below it). On AVX-512, four rows a
// pass in L2 blocks took 0.43-0.76x the time of two rows a pass over all rows at 512 rows of the default model's
// products, 0.61-0.75x at 16 (Xeon-512, 2 threads, two rounds).
constexpr int64_t PAIR_BYTES = 32768;
// Past PAIR_BYTES, the activations go in blocks of rows of at most this many bytes, which stay in L2 while the
// weight rows of a thread's slice pass over them.
constexpr int64_t BLOCK_BYTES = 131072;

// One output: sum_k x[k] * w[k], in 8 running partial sums (k mod 8), then those summed. Plain C++ for CPUs
// without AVX2; it rounds each product before adding it, where the vector paths fuse the two.
float dot_scalar(const float* x, const float* w, int64_t K) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < K; k++) acc[k % 8] = acc[k % 8] + x[k] * w[k];
  const float a = (acc[0] + acc[4]) + (acc[2] + acc[6]), b = (acc[1] + acc[5]) + (acc[3] + acc[7]);
  return a + b;
}

}  // namespace

LK_F32_ROWS(f32_rows_scalar) {
  for (int64_t n = n0; n < n1; n++)
    for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_scalar(x + m * K, w + n * K, K);
}

#if LLAMA_KV_X86
namespace {

LK_AVX2 inline float sum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  const __m128 s4 = _mm_add_ps(lo, hi);                      // lanes (0+4, 1+5, 2+6, 3+7)
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));   // (0+4 + 2+6, 1+5 + 3+7)
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// One weight row against MT activation rows; 8 columns a step, the K % 8 last ones through a masked load.
// (Several weight rows a step measured slower while the activations fit in L1: see PAIR_BYTES.)
template <int MT>
LK_AVX2 void tile_avx2(const float* x, int64_t K, const float* w, float* y, int64_t N, __m256i tail_mask) {
  __m256 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_L2, _MM_HINT_T1);
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int m = 0; m < MT; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
  if (K8 < K) {
    const __m256 wv = _mm256_maskload_ps(w + K8, tail_mask);
    for (int m = 0; m < MT; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + m * K + K8, tail_mask), acc[m]);
  }
  for (int m = 0; m < MT; m++) y[m * N] = sum8(acc[m]);
}

// Weight row n against all M activation rows, four at a time.
LK_AVX2 void row_avx2(const float* x, int64_t M, const float* w, int64_t K, int64_t n, float* y, int64_t N,
                      __m256i tail) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_avx2<4>(x + m * K, K, w + n * K, y + m * N + n, N, tail);
  switch (M - m) {
    case 3: tile_avx2<3>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 2: tile_avx2<2>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 1: tile_avx2<1>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
  }
}

// Three weight rows against MT activation rows (12 running sums at MT = 4, the 16 registers' worth with the
// weights and one activation vector): a prompt's rows make the product compute-bound, and one weight row a pass
// loads an activation vector for every product. Each sum is formed exactly as tile_avx2's.
template <int MT>
LK_AVX2 void tile3_avx2(const float* x, int64_t K, const float* w, float* y, int64_t N, __m256i tail_mask) {
  __m256 a0[MT], a1[MT], a2[MT];
  for (int m = 0; m < MT; m++) a0[m] = a1[m] = a2[m] = _mm256_setzero_ps();
  const float *w1 = w + K, *w2 = w + 2 * K;
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(w + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k);
    for (int m = 0; m < MT; m++) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
      a2[m] = _mm256_fmadd_ps(v2, xv, a2[m]);
    }
  }
  if (K8 < K) {
    const __m256 v0 = _mm256_maskload_ps(w + K8, tail_mask), v1 = _mm256_maskload_ps(w1 + K8, tail_mask),
                 v2 = _mm256_maskload_ps(w2 + K8, tail_mask);
    for (int m = 0; m < MT; m++) {
      const __m256 xv = _mm256_maskload_ps(x + m * K + K8, tail_mask);
      a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
      a2[m] = _mm256_fmadd_ps(v2, xv, a2[m]);
    }
  }
  for (int m = 0; m < MT; m++) {
    y[m * N] = sum8(a0[m]);
    y[m * N + 1] = sum8(a1[m]);
    y[m * N + 2] = sum8(a2[m]);
  }
}

LK_AVX2 void rows3_avx2(const float* x, int64_t M, const float* w, int64_t K, int64_t n, float* y, int64_t N,
                        __m256i tail) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile3_avx2<4>(x + m * K, K, w + n * K, y + m * N + n, N, tail);
  switch (M - m) {
    case 3: tile3_avx2<3>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 2: tile3_avx2<2>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 1: tile3_avx2<1>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
  }
}

LK_AVX512F inline float sum16(__m512 v) {
  // The 16 lanes folded in halves: (i, i + 8), then (i, i + 4), (i, i + 2), (i, i + 1).
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX-512F alone
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <int MT>
LK_AVX512F void tile_avx512(const float* x, int64_t K, const float* w, float* y, int64_t N, __mmask16 tail_mask) {
  __m512 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_L2, _MM_HINT_T1);
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int m = 0; m < MT; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
  }
  if (K16 < K) {
    const __m512 wv = _mm512_maskz_loadu_ps(tail_mask, w + K16);
    for (int m = 0; m < MT; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail_mask, x + m * K + K16), acc[m]);
  }
  for (int m = 0; m < MT; m++) y[m * N] = sum16(acc[m]);
}

// NR weight rows against MT activation rows: NR * MT running sums, where one row's MT chains leave the FMA units
// waiting on their latency once the rows are many enough to make the product compute-bound. Each sum is formed
// exactly as tile_avx512's.
template <int NR, int MT>
LK_AVX512F void tiles_avx512(const float* x, int64_t K, const float* w, float* y, int64_t N, __mmask16 tail_mask) {
  __m512 acc[NR][MT];
  for (int r = 0; r < NR; r++)
    for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 v[NR];
    for (int r = 0; r < NR; r++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + PREFETCH, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + PREFETCH_L2, _MM_HINT_T1);
      v[r] = _mm512_loadu_ps(w + r * K + k);
    }
    for (int m = 0; m < MT; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; r++) acc[r][m] = _mm512_fmadd_ps(v[r], xv, acc[r][m]);
    }
  }
  if (K16 < K) {
    __m512 v[NR];
    for (int r = 0; r < NR; r++) v[r] = _mm512_maskz_loadu_ps(tail_mask, w + r * K + K16);
    for (int m = 0; m < MT; m++) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail_mask, x + m * K + K16);
      for (int r = 0; r < NR; r++) acc[r][m] = _mm512_fmadd_ps(v[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NR; r++) y[m * N + r] = sum16(acc[r][m]);
}

// NR weight rows from n against all M activation rows, four at a time.
template <int NR>
LK_AVX512F void rows_avx512(const float* x, int64_t M, const float* w, int64_t K, int64_t n, float* y, int64_t N,
                            __mmask16 tail) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tiles_avx512<NR, 4>(x + m * K, K, w + n * K, y + m * N + n, N, tail);
  switch (M - m) {
    case 3: tiles_avx512<NR, 3>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 2: tiles_avx512<NR, 2>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 1: tiles_avx512<NR, 1>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
  }
}

LK_AVX512F void row_avx512(const float* x, int64_t M, const float* w, int64_t K, int64_t n, float* y, int64_t N,
                           __mmask16 tail) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_avx512<4>(x + m * K, K, w + n * K, y + m * N + n, N, tail);
  switch (M - m) {
    case 3: tile_avx512<3>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 2: tile_avx512<2>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
    case 1: tile_avx512<1>(x + m * K, K, w + n * K, y + m * N + n, N, tail); break;
  }
}

}  // namespace

LK_AVX2 LK_F32_ROWS(f32_rows_avx2) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; i++) lanes[i] = i < K % 8 ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  if (M * K * int64_t(sizeof(float)) <= PAIR_BYTES) {
    for (int64_t n = n0; n < n1; n++) row_avx2(x, M, w, K, n, y, N, tail);
    return;
  }
  // A prompt's rows: blocks of them that stay in L2, each met by the slice's weight rows three at a time.
  const int64_t block = std::max<int64_t>(4, BLOCK_BYTES / (K * int64_t(sizeof(float))) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    int64_t n = n0;
    for (; n + 3 <= n1; n += 3) rows3_avx2(x + m0 * K, rows, w, K, n, y + m0 * N, N, tail);
    for (; n < n1; n++) row_avx2(x + m0 * K, rows, w, K, n, y + m0 * N, N, tail);
  }
}

LK_AVX512F LK_F32_ROWS(f32_rows_avx512) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1);
  if (M * K * int64_t(sizeof(float)) <= PAIR_BYTES) {
    for (int64_t n = n0; n < n1; n++) row_avx512(x, M, w, K, n, y, N, tail);
    return;
  }
  // As on AVX2, in blocks of rows that stay in L2, four weight rows a pass (16 running sums of the 32 registers).
  const int64_t block = std::max<int64_t>(4, BLOCK_BYTES / (K * int64_t(sizeof(float))) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_avx512<4>(x + m0 * K, rows, w, K, n, y + m0 * N, N, tail);
    for (; n < n1; n++) row_avx512(x + m0 * K, rows, w, K, n, y + m0 * N, N, tail);
  }
}
#else
LK_F32_ROWS(f32_rows_avx2) { f32_rows_scalar(x, M, w, K, n0, n1, y, N); }
LK_F32_ROWS(f32_rows_avx512) { f32_rows_scalar(x, M, w, K, n0, n1, y, N); }
#endif

}  // namespace llama_kv
