// The ops torch sees (namespace llama_kv), registered once: argument checks, the instruction path chosen
// from the CPU's flags at load, activations quantized inside each call, and the work split over output rows
// with torch's own thread pool (at::parallel_for, so torch.set_num_threads holds).
//
//   quantize_activations(x) -> (q, d, sum)               x (M, K) float32 / bf16: int8 blocks, for the tests
//   q8_0_linear(x, weight, scales, out_features)          int8 blocks of 32 (Q8_0)
//   q8_16_linear(x, weight, scales, out_features)         int8 in groups of 16, two scales a block (Q6_K's)
//   q4_0_linear(x, weight, out_features)                  int4 blocks of 32 with a scale (Q4_0), scales inside
//   q4_1_linear(x, weight, out_features)                  int4 blocks of 32 with a minimum too (Q4_1)
//   f32_linear(x, weight)                                 float32 x times a row-major float32 weight, each row
//                                                        as alone (f32_rows.cpp)
//   dequantize_q8_0 / _q8_16 / _q4_0 / _q4_1(...)         the float32 (out, K) weight
//   cpu_paths()                                          the paths this CPU runs, as numbers (kernels.h)
//   set_options(path, gemm_min_rows)                     force a path (-1: the best) and where products
//                                                        switch to dequantize-then-GEMM; returns the old ones
//   get_options()                                        [path, gemm_min_rows] as they are
//
// From gemm_min_rows activation rows on, the activations (still rounded to int8 blocks) and the weights are
// widened to float32 and multiplied by torch's GEMM, a slice of output rows at a time: the same sum of the
// same products, in another order. Measured, the integer kernel was faster at every size from 1 to 2,048 rows
// (docs/benchmarks.md, "Figures behind the code"), so by default it runs at every size and a row's output
// never depends on how many rows came with it; the GEMM stays as an option, to measure again elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "kernels.h"

namespace llama_kv {

const char* path_name(int path) {
  static const char* names[kNumPaths] = {"scalar", "avx2", "avxvnni-emulated", "avxvnni", "avx512", "avx512vnni",
                                             "amx"};
  return path >= 0 && path < kNumPaths ? names[path] : "unknown";
}

namespace {

struct CpuFlags {
  bool avx2 = false, avxvnni = false, avx512 = false, avx512vnni = false;
};

CpuFlags read_cpu_flags() {
  CpuFlags f;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(osxsave && avx)) return f;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool ymm_state = (xcr0_lo & 0x6) == 0x6;      // the OS saves SSE and AVX registers
  const bool zmm_state = (xcr0_lo & 0xE6) == 0xE6;    // ... and the AVX-512 ones
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  const bool avx512_vnni = c & (1u << 11);
  unsigned a1 = 0, b1, c1, d1;
  const bool has_leaf_7_1 = a >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx_vnni = has_leaf_7_1 && (a1 & (1u << 4));
  f.avx2 = ymm_state && avx2 && fma && f16c;
  f.avxvnni = f.avx2 && avx_vnni;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512bw && avx512vl;
  f.avx512vnni = f.avx512 && avx512_vnni;
#endif
  return f;
}

const CpuFlags& cpu() {
  static const CpuFlags flags = read_cpu_flags();
  return flags;
}

// The paths from the best down; the emulated one is never chosen by itself (it is for tests).
int best_path() {
  for (int p = kNumPaths - 1; p > kScalar; p--)
    if (p != kAvxVnniEmulated && cpu_supports(p)) return p;
  return kScalar;
}

std::atomic<int> forced_path{-1};
// Never, by default: the integer kernel measured faster at every size (see the top of this file).
std::atomic<int64_t> gemm_min_rows{std::numeric_limits<int64_t>::max()};

int active_path() {
  const int p = forced_path.load();
  return p >= 0 ? p : best_path();
}

// One call's activations rounded to int8 blocks, with each block's scale and sums, held in a buffer of the
// calling thread's that is kept from call to call: a decode step makes over 200 small products, and four
// tensors allocated for each cost more than rounding the row.
struct Activations {
  int64_t M = 0, K = 0;
  int8_t* q = nullptr;
  float *d = nullptr, *s = nullptr;
  int32_t *sum = nullptr, *sum16 = nullptr;
  const ActRow* rows = nullptr;
};

// `bytes` of this thread's scratch, 64-byte aligned; valid until its next call. It keeps its largest size: for a
// prompt chunk of 512 rows into 7B's widest layer (11,008 columns), 8 MB.
uint8_t* scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes + 64) {
    buffer.clear();
    buffer.shrink_to_fit();
    buffer.resize(bytes + 64);
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - p % 64) % 64);
}

// x: M rows of K float32 or bf16 values, contiguous. `half_sums`: also each block's sum of its first 16 values,
// which the groups-of-16 kernels take 128 times off the first half.
Activations quantize(const void* x, bool bf16, int64_t M, int64_t K, int path, bool half_sums) {
  const int64_t nb = K / QK;
  auto up = [](int64_t n) { return (n + 63) / 64 * 64; };
  const int64_t q_bytes = up(M * K), blocks = up(M * nb * 4);
  uint8_t* base = scratch(q_bytes + 4 * blocks);
  Activations a;
  a.M = M;
  a.K = K;
  a.q = reinterpret_cast<int8_t*>(base);
  a.d = reinterpret_cast<float*>(base + q_bytes);
  a.s = reinterpret_cast<float*>(base + q_bytes + blocks);
  a.sum = reinterpret_cast<int32_t*>(base + q_bytes + 2 * blocks);
  int8_t* q = a.q;
  float *d = a.d, *s = a.s;
  int32_t* sum = a.sum;
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      if (bf16)
        quantize_row_bf16(path, static_cast<const uint16_t*>(x) + m * K, K, q + m * K, d + m * nb, sum + m * nb,
                          s + m * nb);
      else
        quantize_row_f32(path, static_cast<const float*>(x) + m * K, K, q + m * K, d + m * nb, sum + m * nb,
                         s + m * nb);
    }
  });
  if (half_sums) {
    a.sum16 = reinterpret_cast<int32_t*>(base + q_bytes + 3 * blocks);
    for (int64_t b = 0; b < M * nb; b++) {
      int32_t total = 0;
      for (int i = 0; i < QK / 2; i++) total += q[b * QK + i];
      a.sum16[b] = total;
    }
  }
  thread_local std::vector<ActRow> rows;
  rows.resize(M);
  for (int64_t m = 0; m < M; m++)
    rows[m] = {q + m * K, d + m * nb, sum + m * nb, s + m * nb, half_sums ? a.sum16 + m * nb : nullptr};
  a.rows = rows.data();
  return a;
}

// The activations of an op as rows of K: checked, and copied only if they are not contiguous.
struct Input {
  at::Tensor held;  // the contiguous copy, if one was needed
  const void* data;
  bool bf16;
  int64_t M, K;
};

Input rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": activations must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": activations must be float32 or bfloat16, not ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % QK == 0, op, ": the last dimension (", x.size(-1),
              ") must be a multiple of ", QK);
  Input in;
  if (!x.is_contiguous()) in.held = x.contiguous();
  const at::Tensor& c = x.is_contiguous() ? x : in.held;
  in.data = c.data_ptr();
  in.bf16 = x.scalar_type() == at::kBFloat16;
  in.K = x.size(-1);
  in.M = in.K ? x.numel() / in.K : 0;
  return in;
}

// A float32 output of x's shape but for its last dimension, `n`; no dispatcher call.
at::Tensor new_output(const at::Tensor& x, int64_t n) {
  c10::SmallVector<int64_t, 4> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::detail::empty_cpu(shape, at::kFloat, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

// int8 weights: (groups, K / 32, 256) int8 and float16 scales, (groups, K / 32, 8), or in groups of 16
// (groups, K / 32, 2, 8).
void check_q8_weight(const at::Tensor& weight, const at::Tensor& scales, int64_t K, int64_t out_features, bool halves,
                     const char* op) {
  const int64_t groups = (out_features + ROWS - 1) / ROWS, nb = K / QK;
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.sizes() == at::IntArrayRef({groups, nb, Q8_BLOCK_BYTES}),
              op, ": weight must be contiguous int8 of shape (", groups, ", ", nb, ", ", Q8_BLOCK_BYTES, "), not ",
              weight.scalar_type(), " ", weight.sizes());
  const std::vector<int64_t> want = halves ? std::vector<int64_t>{groups, nb, 2, ROWS} : std::vector<int64_t>{groups, nb, ROWS};
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.sizes() == at::IntArrayRef(want),
              op, ": scales must be contiguous float16 of shape ", at::IntArrayRef(want), ", not ", scales.sizes());
}

// y, float32, in x's dtype.
at::Tensor in_dtype_of(const at::Tensor& x, const at::Tensor& y) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Work in slices of whole groups of at least this many weight bytes per thread, so that small layers do not
// pay for waking threads they do not need.
constexpr int64_t kMinBytesPerTask = 1 << 15;

// Dequantize-then-GEMM into y (M, out_features): the quantized activations widened (q * d), times the widened
// weight, a slice of groups at a time: 16 MB of float32 scratch, few enough slices that waking the threads for
// each costs little.
template <typename Dequantize>
void gemm(const Activations& a, int64_t out_features, int64_t group_bytes, int64_t group_rows, at::Tensor y,
          Dequantize dequantize_groups) {
  const int64_t M = a.M, K = a.K, nb = K / QK, groups = (out_features + group_rows - 1) / group_rows;
  const at::Tensor xf = (at::from_blob(a.q, {M, nb, QK}, at::kChar).to(at::kFloat) *
                         at::from_blob(a.d, {M, nb, 1}, at::kFloat)).view({M, K});
  const int64_t kSlice = std::min(groups, std::max<int64_t>(1, (int64_t(1) << 22) / (group_rows * K)));
  at::Tensor wf = at::empty({kSlice * group_rows, K}, xf.options());
  for (int64_t g = 0; g < groups; g += kSlice) {
    const int64_t n = std::min(kSlice, groups - g), rows = std::min(n * group_rows, out_features - g * group_rows);
    float* out = wf.data_ptr<float>();
    at::parallel_for(g, g + n, std::max<int64_t>(1, kMinBytesPerTask / group_bytes),
                     [&](int64_t s, int64_t e) { dequantize_groups(s, e, out + (s - g) * group_rows * K); });
    y.narrow(1, g * group_rows, rows).copy_(at::mm(xf, wf.narrow(0, 0, rows).t()));
  }
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features,
                     bool halves) {
  const char* op = halves ? "q8_16_linear" : "q8_0_linear";
  const Input in = rows_of(x, op);
  const int64_t M = in.M, K = in.K, nb = K / QK, groups = (out_features + ROWS - 1) / ROWS;
  check_q8_weight(weight, scales, K, out_features, halves, op);
  const int path = active_path();
  const Activations a = quantize(in.data, in.bf16, M, K, path, halves);
  const int8_t* w = weight.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  at::Tensor y = new_output(x, out_features);
  if (M >= gemm_min_rows.load()) {
    gemm(a, out_features, nb * Q8_BLOCK_BYTES, ROWS, y.view({M, out_features}), [&](int64_t g0, int64_t g1, float* out) {
      dequantize_q8_0(halves, w, sc, nb, g0, g1, out);
    });
    return in_dtype_of(x, y);
  }
  float* yp = y.data_ptr<float>();
  const ActRow* rows = a.rows;
  using Gemv = void (*)(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const ActRow*, int64_t, float*, int64_t);
  // The AMX path is AVX-512 VNNI's for fewer than 16 rows, for the rows past the last 16, and in groups of 16.
  static const Gemv q8_0[kNumPaths] = {gemv_q8_0_scalar, gemv_q8_0_avx2, gemv_q8_0_avxvnni_emulated,
                                       gemv_q8_0_avxvnni, gemv_q8_0_avx512, gemv_q8_0_avx512vnni,
                                       gemv_q8_0_avx512vnni};
  static const Gemv q8_16[kNumPaths] = {gemv_q8_16_scalar, gemv_q8_16_avx2, gemv_q8_16_avxvnni_emulated,
                                        gemv_q8_16_avxvnni, gemv_q8_16_avx512, gemv_q8_16_avx512vnni,
                                        gemv_q8_16_avx512vnni};
  const Gemv gemv = (halves ? q8_16 : q8_0)[path];
  const int64_t tiled = path == kAmx && !halves ? M / 16 * 16 : 0;  // rows on the tiles
  at::parallel_for(0, groups, std::max<int64_t>(1, kMinBytesPerTask / (nb * Q8_BLOCK_BYTES)),
                   [&](int64_t g0, int64_t g1) {
                     if (tiled) gemm_q8_0_amx(w, sc, nb, g0, g1, rows, tiled, yp, out_features);
                     if (tiled < M) gemv(w, sc, nb, g0, g1, rows + tiled, M - tiled, yp + tiled * out_features, out_features);
                   });
  return in_dtype_of(x, y);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return q8_linear(x, weight, scales, out_features, false);
}

at::Tensor q8_16_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return q8_linear(x, weight, scales, out_features, true);
}

// int4 weights: (units, K / 32, block_bytes) uint8, one unit's blocks of values and scales (kernels.h).
void check_q4_weight(const at::Tensor& weight, int64_t K, int64_t out_features, bool has_mins, const char* op) {
  const int64_t units = (out_features + Q4_ROWS - 1) / Q4_ROWS, block = has_mins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.sizes() == at::IntArrayRef({units, K / QK, block}),
              op, ": weight must be contiguous uint8 of shape (", units, ", ", K / QK, ", ", block, "), not ",
              weight.scalar_type(), " ", weight.sizes());
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features, bool has_mins) {
  const char* op = has_mins ? "q4_1_linear" : "q4_0_linear";
  const Input in = rows_of(x, op);
  const int64_t M = in.M, K = in.K, nb = K / QK, units = (out_features + Q4_ROWS - 1) / Q4_ROWS;
  check_q4_weight(weight, K, out_features, has_mins, op);
  const int64_t unit_bytes = nb * (has_mins ? Q4_1_BLOCK_BYTES : Q4_0_BLOCK_BYTES);
  const int path = active_path();
  const Activations a = quantize(in.data, in.bf16, M, K, path, false);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::Tensor y = new_output(x, out_features);
  if (M >= gemm_min_rows.load()) {
    gemm(a, out_features, unit_bytes, Q4_ROWS, y.view({M, out_features}), [&](int64_t u0, int64_t u1, float* out) {
      dequantize_q4(has_mins, w, nb, u0, u1, out);
    });
    return in_dtype_of(x, y);
  }
  float* yp = y.data_ptr<float>();
  const ActRow* rows = a.rows;
  using Gemv = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const ActRow*, int64_t, float*, int64_t);
  static const Gemv q4_0[kNumPaths] = {gemv_q4_0_scalar, gemv_q4_0_avx2, gemv_q4_0_avxvnni_emulated,
                                       gemv_q4_0_avxvnni, gemv_q4_0_avx512, gemv_q4_0_avx512vnni,
                                       gemv_q4_0_avx512vnni};
  static const Gemv q4_1[kNumPaths] = {gemv_q4_1_scalar, gemv_q4_1_avx2, gemv_q4_1_avxvnni_emulated,
                                       gemv_q4_1_avxvnni, gemv_q4_1_avx512, gemv_q4_1_avx512vnni,
                                       gemv_q4_1_avx512vnni};
  const Gemv gemv = (has_mins ? q4_1 : q4_0)[path];
  const Gemv tiles = has_mins ? gemm_q4_1_amx : gemm_q4_0_amx;
  const int64_t tiled = path == kAmx ? M / 16 * 16 : 0;  // rows on the tiles
  at::parallel_for(0, units, std::max<int64_t>(1, kMinBytesPerTask / unit_bytes), [&](int64_t u0, int64_t u1) {
    if (tiled) tiles(w, nb, u0, u1, rows, tiled, yp, out_features);
    if (tiled < M) gemv(w, nb, u0, u1, rows + tiled, M - tiled, yp + tiled * out_features, out_features);
  });
  return in_dtype_of(x, y);
}

at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features) {
  return q4_linear(x, weight, out_features, false);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features) {
  return q4_linear(x, weight, out_features, true);
}

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& weight) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, "f32_linear: activations "
              "must be float32 on the CPU, not ", x_in.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() && x_in.size(-1) == K,
              "f32_linear: weight must be a contiguous (out, ", x_in.size(-1), ") float32 matrix, not ",
              weight.scalar_type(), " ", weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous)");
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  at::Tensor y = new_output(x_in, N);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int path = active_path();
  // Slices of at least kMinBytesPerTask of weights, in whole fours of rows (the AVX-512 path's step).
  const int64_t grain = std::max<int64_t>(4, (kMinBytesPerTask / (K * 4) + 3) / 4 * 4);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (path >= kAvx512)
      f32_rows_avx512(xp, M, wp, K, n0, n1, yp, N);
    else if (path >= kAvx2)
      f32_rows_avx2(xp, M, wp, K, n0, n1, yp, N);
    else
      f32_rows_scalar(xp, M, wp, K, n0, n1, yp, N);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const Input in = rows_of(x_in, "quantize_activations");
  const Activations a = quantize(in.data, in.bf16, in.M, in.K, active_path(), false);
  const int64_t nb = in.K / QK;
  return {at::from_blob(a.q, {in.M, in.K}, at::kChar).clone(), at::from_blob(a.d, {in.M, nb}, at::kFloat).clone(),
          at::from_blob(a.sum, {in.M, nb}, at::kInt).clone()};
}

at::Tensor dequantize_q8_op(const at::Tensor& weight, const at::Tensor& scales, int64_t out_features, bool halves) {
  const int64_t nb = weight.size(1), K = nb * QK, groups = weight.size(0);
  check_q8_weight(weight, scales, K, out_features, halves, halves ? "dequantize_q8_16" : "dequantize_q8_0");
  at::Tensor out = at::empty({groups * ROWS, K}, weight.options().dtype(at::kFloat));
  dequantize_q8_0(halves, weight.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), nb,
                  0, groups, out.data_ptr<float>());
  return out.narrow(0, 0, out_features);
}

at::Tensor dequantize_q8_0_op(const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return dequantize_q8_op(weight, scales, out_features, false);
}

at::Tensor dequantize_q8_16_op(const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return dequantize_q8_op(weight, scales, out_features, true);
}

at::Tensor dequantize_q4_op(const at::Tensor& weight, int64_t out_features, bool has_mins) {
  const int64_t nb = weight.size(1), units = weight.size(0);
  check_q4_weight(weight, nb * QK, out_features, has_mins, has_mins ? "dequantize_q4_1" : "dequantize_q4_0");
  at::Tensor out = at::empty({units * Q4_ROWS, nb * QK}, weight.options().dtype(at::kFloat));
  dequantize_q4(has_mins, weight.data_ptr<uint8_t>(), nb, 0, units, out.data_ptr<float>());
  return out.narrow(0, 0, out_features);
}

at::Tensor dequantize_q4_0_op(const at::Tensor& weight, int64_t out_features) {
  return dequantize_q4_op(weight, out_features, false);
}

at::Tensor dequantize_q4_1_op(const at::Tensor& weight, int64_t out_features) {
  return dequantize_q4_op(weight, out_features, true);
}

std::vector<int64_t> cpu_paths() {
  std::vector<int64_t> paths;
  for (int p = 0; p < kNumPaths; p++)
    if (cpu_supports(p)) paths.push_back(p);
  return paths;
}

std::vector<int64_t> get_options() { return {forced_path.load(), gemm_min_rows.load()}; }

std::vector<int64_t> set_options(int64_t path, int64_t min_rows) {
  TORCH_CHECK(path >= -1 && path < kNumPaths && (path == -1 || cpu_supports(int(path))), "llama_kv: path ", path,
              " (", path_name(int(path)), ") does not run on this CPU");
  TORCH_CHECK(min_rows >= 1, "llama_kv: gemm_min_rows must be at least 1");
  std::vector<int64_t> old = {forced_path.load(), gemm_min_rows.load()};
  forced_path.store(int(path));
  gemm_min_rows.store(min_rows);
  return old;
}

}  // namespace

int kernel_path() { return active_path(); }

bool cpu_supports(int path) {
  switch (path) {
    case kScalar: return true;
    case kAvx2:
    case kAvxVnniEmulated: return cpu().avx2;
    case kAvxVnni: return cpu().avxvnni;
    case kAvx512: return cpu().avx512;
    case kAvx512Vnni: return cpu().avx512vnni;
    case kAmx: return cpu().avx512vnni && cpu_runs_amx();
    default: return false;
  }
}

TORCH_LIBRARY(llama_kv, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("q8_0_linear(Tensor x, Tensor weight, Tensor scales, int out_features) -> Tensor");
  m.def("q8_16_linear(Tensor x, Tensor weight, Tensor scales, int out_features) -> Tensor");
  m.def("q4_0_linear(Tensor x, Tensor weight, int out_features) -> Tensor");
  m.def("q4_1_linear(Tensor x, Tensor weight, int out_features) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("dequantize_q8_0(Tensor weight, Tensor scales, int out_features) -> Tensor");
  m.def("dequantize_q8_16(Tensor weight, Tensor scales, int out_features) -> Tensor");
  m.def("dequantize_q4_0(Tensor weight, int out_features) -> Tensor");
  m.def("dequantize_q4_1(Tensor weight, int out_features) -> Tensor");
  m.def("cpu_paths() -> int[]", &cpu_paths);
  m.def("get_options() -> int[]", &get_options);
  m.def("set_options(int path, int gemm_min_rows) -> int[]", &set_options);
}

TORCH_LIBRARY_IMPL(llama_kv, CPU, m) {
  m.impl("quantize_activations", &quantize_activations);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q8_16_linear", &q8_16_linear);
  m.impl("q4_0_linear", &q4_0_linear);
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("f32_linear", &f32_linear);
  m.impl("dequantize_q8_0", &dequantize_q8_0_op);
  m.impl("dequantize_q8_16", &dequantize_q8_16_op);
  m.impl("dequantize_q4_0", &dequantize_q4_0_op);
  m.impl("dequantize_q4_1", &dequantize_q4_1_op);
}

}  // namespace llama_kv

// C entry points for steps compiled ahead of time: told of them (llama/aot.py), AOTInductor's code calls
// aoti_torch_cpu_<op> directly instead of boxing every argument through the dispatcher (about 3 us a call).
// (LLAMA_KV_SHIM and LLAMA_KV_TENSOR, T for short here: kernels.h.)
#define T LLAMA_KV_TENSOR

extern "C" {
LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_q8_0_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                          AtenTensorHandle scales, int64_t out_features,
                                                          AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::q8_0_linear(T(x), T(weight), T(scales), out_features));
}
LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_q8_16_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                           AtenTensorHandle scales, int64_t out_features,
                                                           AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::q8_16_linear(T(x), T(weight), T(scales), out_features));
}
LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_q4_0_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                          int64_t out_features, AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::q4_0_linear(T(x), T(weight), out_features));
}
LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_q4_1_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                          int64_t out_features, AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::q4_1_linear(T(x), T(weight), out_features));
}
LLAMA_KV_EXPORT AOTITorchError aoti_torch_cpu_f32_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                         AtenTensorHandle* out) {
  LLAMA_KV_SHIM(llama_kv::f32_linear(T(x), T(weight)));
}
}
