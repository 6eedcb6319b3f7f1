// int8 products of a prompt's many rows on AMX tiles (Intel Xeons from Sapphire Rapids on), where the CPU and the
// kernel let this process use them. Sixteen activation rows and two groups of weights at a time: for each block,
// the int32 dot products of the 16 x 16 pairs come from two tile multiplies (tdpbssd), and each output then takes
// its block exactly as the scalar loop does, fmaf(dw * da, float(isum), acc), in block order. The int32 sums are
// exact, so every row's outputs are the scalar loop's bits, as on every other path, whatever rows come with it.
//
// A weight group's block is already a tile: its 256 bytes are 8 rows of 4 bytes for each of the 8 output rows
// (kernels.h), the layout tdpbssd reads its second operand in. The activations' block of 16 rows is a tile of
// 16 rows of 32 bytes, K bytes apart.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "kernels.h"

#if LLAMA_KV_X86 && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define LLAMA_KV_AMX 1
#include <cpuid.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#else
#define LLAMA_KV_AMX 0
#endif

namespace llama_kv {

#if LLAMA_KV_AMX

#define LK_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

namespace {

// The tiles: 0 and 1 (5 and 6) the sums of two groups (16 rows x 8 int32), 2 (7) the activations' block (16 rows x
// 32 bytes), 3 and 4 the two groups' blocks (8 rows x 32 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {32, 32, 32, 32, 32, 32, 32, 32};
  uint8_t rows[16] = {16, 16, 16, 8, 8, 16, 16, 16};
};

LK_AMX void tiles_on() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

LK_AMX void tiles_off() { _tile_release(); }

// One product on the tiles, to see that they run: a CPU (or a virtual machine) may report AMX and still stop the
// first tile instruction.
LK_AMX int32_t one_product() {
  alignas(64) int8_t a[16 * 32], b[8 * 32];
  alignas(64) int32_t c[16 * 8];
  for (int i = 0; i < 16 * 32; i++) a[i] = int8_t(i % 7 - 3);
  for (int i = 0; i < 8 * 32; i++) b[i] = int8_t(i % 5 - 2);
  tiles_on();
  _tile_zero(0);
  _tile_loadd(2, a, 32);
  _tile_loadd(3, b, 32);
  _tile_dpbssd(0, 2, 3);
  _tile_stored(0, c, 32);
  tiles_off();
  int32_t want = 0;  // c[0][0]: row 0 of a against column 0 of b (bytes 4j .. 4j + 3 of b's row j)
  for (int j = 0; j < 8; j++)
    for (int k = 0; k < 4; k++) want += int32_t(a[4 * j + k]) * b[32 * j + k];
  return c[0] == want ? 0 : 1;
}

// Whether this process may use the tiles: the CPU's flags, the kernel's permission (Linux hands out the tiles'
// state only on request, ARCH_REQ_XCOMP_PERM), and one product computed right in a child process, where an
// illegal instruction stops only the child.
bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!(tile && int8)) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;  // the OS saves the tiles' configuration and data
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  const pid_t child = fork();
  if (child < 0) return false;
  if (child == 0) _exit(one_product());
  int status = 0;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Groups whose blocks a thread multiplies by every 16 rows before it goes on: about 256 KB of weights, which stay
// in its L2 while every activation row passes them.
constexpr int64_t kBlockBytes = 1 << 18;

}  // namespace

bool cpu_runs_amx() {
  static const bool usable = amx_usable();
  return usable;
}

namespace {

// Block b of the 16 rows against groups g (tiles C0, from w0) and g + 1 (C1, from w1, where `pair`), into sums:
// sums[16 r + c] for group g's output row c, sums[16 r + 8 + c] for group g + 1's. A macro, as GCC's tile
// intrinsics take the tiles' numbers as written.
#define LK_BLOCK_SUMS(C0, C1, A, aq, K, w0, w1, pair, sums) \
  do {                                                     \
    _tile_zero(C0);                                        \
    _tile_loadd(A, aq, K);                                 \
    _tile_loadd(3, w0, 32);                                \
    _tile_dpbssd(C0, A, 3);                                \
    if (pair) {                                            \
      _tile_zero(C1);                                      \
      _tile_loadd(4, w1, 32);                              \
      _tile_dpbssd(C1, A, 4);                              \
      _tile_stored(C1, (sums) + 8, 64);                    \
    }                                                      \
    _tile_stored(C0, sums, 64);                            \
  } while (0)

// int8 weights: two groups (16 output rows) at a time, each group's block a tile as it is stored.
struct Q8Groups {
  const int8_t* w;
  const uint16_t* scales;
  int64_t nb, g1;
  static constexpr int kStep = 2;  // groups
  void prepare(int64_t, int64_t) {}
  bool pair(int64_t g) const { return g + 1 < g1; }
  const int8_t* tile(int64_t g, int64_t b, int h) const { return w + ((g + h) * nb + b) * Q8_BLOCK_BYTES; }
  // Block b's sums into the 16 rows' accumulators, as the scalar loop adds a block: fmaf(dw * da, float(isum), acc).
  LK_AMX void add(const int32_t* sums, int64_t g, int64_t b, const ActRow* act, __m512* acc) const {
    const uint16_t* sc = scales + (g * nb + b) * ROWS;
    const __m128i half0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m128i half1 = pair(g) ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + nb * ROWS)) : _mm_setzero_si128();
    const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(half0), half1, 1));
    for (int r = 0; r < 16; r++) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(act[r].d[b]));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)), acc[r]);
    }
  }
  void store(const float* out, float* yr, int64_t g, int64_t out_features) const {
    store_rows(out, ROWS, yr, g * ROWS, out_features);
    if (pair(g)) store_rows(out + ROWS, ROWS, yr, (g + 1) * ROWS, out_features);
  }
};

// int4 weights: a unit (16 output rows) at a time. Its values are widened to int8 tiles once for every 16 activation
// rows: half h's block as 8 rows of 4 bytes for each of its 8 output rows, rows 0-3 the low nibbles (values 0-15
// of the block), rows 4-7 the high ones (16-31).
template <bool kMins>
struct Q4Units {
  const uint8_t* w;
  int64_t nb, u1;
  int8_t* widened;  // the span's units: [unit][block][half][8][32]
  int64_t first = 0;
  static constexpr int kStep = 1;  // units
  static constexpr int64_t kBlockBytes = kMins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  LK_AMX void prepare(int64_t s0, int64_t s1) {
    first = s0;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t u = s0; u < s1; u++)
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* block = w + (u * nb + b) * kBlockBytes;
        int8_t* t = widened + ((u - s0) * nb + b) * 2 * Q8_BLOCK_BYTES;
        for (int p = 0; p < 4; p++) {  // bytes 64p .. 64p + 63: both halves' row p
          const __m512i v = _mm512_loadu_si512(block + 64 * p);
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          _mm256_store_si256(reinterpret_cast<__m256i*>(t + 32 * p), _mm512_castsi512_si256(lo));
          _mm256_store_si256(reinterpret_cast<__m256i*>(t + 32 * (p + 4)), _mm512_castsi512_si256(hi));
          _mm256_store_si256(reinterpret_cast<__m256i*>(t + Q8_BLOCK_BYTES + 32 * p), _mm512_extracti64x4_epi64(lo, 1));
          _mm256_store_si256(reinterpret_cast<__m256i*>(t + Q8_BLOCK_BYTES + 32 * (p + 4)), _mm512_extracti64x4_epi64(hi, 1));
        }
      }
  }
  bool pair(int64_t) const { return true; }
  const int8_t* tile(int64_t u, int64_t b, int h) const {
    return widened + (((u - first) * nb + b) * 2 + h) * Q8_BLOCK_BYTES;
  }
  // As the scalar loop adds a block: Q4_0 fmaf(dw * da, float(isum - 8 * asum), acc); Q4_1 fmaf(dw * da, float(isum),
  // acc), then fmaf(mw, da * asum, acc).
  LK_AMX void add(const int32_t* sums, int64_t u, int64_t b, const ActRow* act, __m512* acc) const {
    const uint8_t* block = w + (u * nb + b) * kBlockBytes;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + Q4_VALUE_BYTES)));
    const __m512 mw = kMins ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(block + Q4_VALUE_BYTES + 2 * Q4_ROWS)))
                            : _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(act[r].d[b]));
      __m512i isum = _mm512_load_si512(sums + 16 * r);
      if (!kMins) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * act[r].sum[b]));
      acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[r]);
      if (kMins) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(act[r].s[b]), acc[r]);
    }
  }
  void store(const float* out, float* yr, int64_t u, int64_t out_features) const {
    store_rows(out, Q4_ROWS, yr, u * Q4_ROWS, out_features);
  }
};

// Rows 0 .. M (a multiple of 16) against `kind`'s weights n0 .. n1 (groups or units), a span of them at a time
// (`span`, a multiple of kind.kStep: about kBlockBytes of tiles), every 16 rows passing the span before the next.
template <typename Kind>
LK_AMX void tiled(Kind& kind, int64_t n0, int64_t n1, int64_t span, const ActRow* act, int64_t M, float* y,
                  int64_t out_features) {
  const int64_t nb = kind.nb, K = nb * QK;
  // kBatch blocks' sums: the tiles multiply them (in turn on tiles 0, 1 and 2 and on 5, 6 and 7), then the vector
  // units add them.
  constexpr int kBatch = 8;
  alignas(64) int32_t sums[kBatch][16 * 16] = {};
  alignas(64) float out[16];
  tiles_on();
  for (int64_t s0 = n0; s0 < n1; s0 += span) {
    const int64_t s1 = std::min(n1, s0 + span);
    kind.prepare(s0, s1);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int8_t* aq = act[m0].q;  // 16 rows, K bytes apart (the activations' buffer, ops.cpp)
      for (int64_t g = s0; g < s1; g += Kind::kStep) {
        const bool pair = kind.pair(g);
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += kBatch) {
          const int64_t n = std::min<int64_t>(kBatch, nb - b0);
          for (int64_t i = 0; i < n; i++) {
            const int64_t b = b0 + i;
            const int8_t *w0 = kind.tile(g, b, 0), *w1 = pair ? kind.tile(g, b, 1) : nullptr;
            if (i % 2 == 0)
              LK_BLOCK_SUMS(0, 1, 2, aq + b * QK, K, w0, w1, pair, sums[i]);
            else
              LK_BLOCK_SUMS(5, 6, 7, aq + b * QK, K, w0, w1, pair, sums[i]);
          }
          for (int64_t i = 0; i < n; i++) kind.add(sums[i], g, b0 + i, act + m0, acc);
        }
        for (int r = 0; r < 16; r++) {
          _mm512_store_ps(out, acc[r]);
          kind.store(out, y + (m0 + r) * out_features, g, out_features);
        }
      }
    }
  }
  tiles_off();
}

}  // namespace

LK_AMX void gemm_q8_0_amx(const int8_t* w, const uint16_t* scales, int64_t nb, int64_t g0, int64_t g1,
                          const ActRow* act, int64_t M, float* y, int64_t out_features) {
  Q8Groups kind{w, scales, nb, g1};
  tiled(kind, g0, g1, std::max<int64_t>(2, kBlockBytes / (nb * Q8_BLOCK_BYTES) / 2 * 2), act, M, y, out_features);
}

template <bool kMins>
LK_AMX void gemm_q4_amx(const uint8_t* w, int64_t nb, int64_t u0, int64_t u1, const ActRow* act, int64_t M,
                        float* y, int64_t out_features) {
  const int64_t span = std::max<int64_t>(1, kBlockBytes / (nb * 2 * Q8_BLOCK_BYTES));
  thread_local std::vector<int8_t> widened;
  const size_t bytes = size_t(span * nb * 2 * Q8_BLOCK_BYTES) + 64;
  if (widened.size() < bytes) widened.resize(bytes);
  int8_t* base = widened.data() + (64 - reinterpret_cast<uintptr_t>(widened.data()) % 64) % 64;
  Q4Units<kMins> kind{w, nb, u1, base};
  tiled(kind, u0, u1, span, act, M, y, out_features);
}

LK_GEMV_Q4(gemm_q4_0_amx) { gemm_q4_amx<false>(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemm_q4_1_amx) { gemm_q4_amx<true>(w, nb, u0, u1, act, M, y, out_features); }

#undef LK_BLOCK_SUMS

#else

bool cpu_runs_amx() { return false; }

LK_GEMV_Q8_0(gemm_q8_0_amx) { gemv_q8_0_scalar(w, scales, nb, g0, g1, act, M, y, out_features); }
LK_GEMV_Q4(gemm_q4_0_amx) { gemv_q4_0_scalar(w, nb, u0, u1, act, M, y, out_features); }
LK_GEMV_Q4(gemm_q4_1_amx) { gemv_q4_1_scalar(w, nb, u0, u1, act, M, y, out_features); }

#endif

}  // namespace llama_kv
