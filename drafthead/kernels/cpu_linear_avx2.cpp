// fp32 projection y = x @ w.T (+ b) for CPU decoding on AVX2/FMA CPUs, built by drafthead/kernels/cpu_linear.py.
//
// Why: on CPUs without native bf16 the runtime decodes in fp32, and oneDNN's fp32 matmul at 1-16 rows streamed
// SmolLM2's weights at 4.5-6.8 GB/s on a 2-core AVX2 EPYC that reads memory at ~22 GB/s, and changed kernels
// with the row count (a verify block did not round like single steps). This kernel streams each weight once
// per call for up to kRows rows at a time and computes every output with one fixed instruction sequence, so
// a row's bits do not depend on how many rows share the call.
//
// Weights are packed once to [ceil(N/8), K, 8]: one 256-bit register holds w[n0..n0+7, k]. Three storage
// types, all accumulated in fp32 over k in order (one FMA per k, no horizontal sums):
//   fp32 - the weights as they are;
//   bf16 - the upper 16 bits of each fp32 weight (round-to-nearest-even done in Python), half the bytes;
//   int8 - symmetric per-output-row quantization, a quarter of the bytes; y = scale[n] * sum_k x[k] q[n, k].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kLanes = 8;  // outputs per packed block
constexpr int kBlocks = 6;     // packed blocks per work item (48 outputs)
constexpr int kRows = 4;       // rows of x per tile (4 x 3 accumulators + 3 weights + 1 broadcast = 16 ymm)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 -> fp32 is a 16-bit shift into the high half
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

inline __m256i tail_mask(int64_t valid) {
  alignas(32) int32_t m[8];
  for (int i = 0; i < 8; ++i) m[i] = i < valid ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
}

// Rows m0..m0+R-1 of x against packed blocks b0..b0+B-1.
template <typename W, int R, int B>
inline void tile(const float* x, int64_t K, const W* p, const float* scale, const float* bias, int64_t b0,
                 float* y, int64_t N, int64_t m0) {
  const int64_t block = K * kLanes;
  __m256 acc[R][B];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < B; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = x + (m0 + i) * K;
  const W* pb = p + b0 * block;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[B];
    for (int j = 0; j < B; ++j) w[j] = load8(pb + j * block + k * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr[i] + k);
      for (int j = 0; j < B; ++j) acc[i][j] = _mm256_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
  for (int j = 0; j < B; ++j) {
    const int64_t n = (b0 + j) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, N - n);
    const __m256i mask = tail_mask(valid);
    const __m256 sj = scale ? _mm256_maskload_ps(scale + n, mask) : _mm256_set1_ps(1.0f);
    const __m256 bj = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m256 v = scale ? _mm256_mul_ps(acc[i][j], sj) : acc[i][j];
      _mm256_maskstore_ps(y + (m0 + i) * N + n, mask, bias ? _mm256_add_ps(v, bj) : v);
    }
  }
}

// Blocks b0..b0+B-1 for every row: 4-row tiles of 3 blocks; a lone row (a decode step) takes all B blocks
// at once, so B independent FMA chains hide the FMA latency (3 chains left a 1-row call latency-bound).
template <typename W, int B>
inline void rows(const float* x, int64_t M, int64_t K, const W* p, const float* scale, const float* bias,
                 int64_t b0, float* y, int64_t N) {
  static_assert(B == 1 || B % 3 == 0, "B is 1 or a multiple of 3");
  constexpr int S = B == 1 ? 1 : 3;  // blocks per multi-row tile
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    for (int j = 0; j < B; j += S) tile<W, kRows, S>(x, K, p, scale, bias, b0 + j, y, N, m);
  switch (M - m) {
    case 3: for (int j = 0; j < B; j += S) tile<W, 3, S>(x, K, p, scale, bias, b0 + j, y, N, m); break;
    case 2: for (int j = 0; j < B; j += S) tile<W, 2, S>(x, K, p, scale, bias, b0 + j, y, N, m); break;
    case 1: tile<W, 1, B>(x, K, p, scale, bias, b0, y, N, m); break;
    default: break;
  }
}

template <typename W>
void run(const float* X, int64_t M, int64_t K, const W* P, int64_t NB, const float* S, const float* Bp, float* Y,
         int64_t N) {
  const int64_t groups = (NB + kBlocks - 1) / kBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kBlocks;
      if (b0 + kBlocks <= NB) {
        rows<W, kBlocks>(X, M, K, P, S, Bp, b0, Y, N);
      } else {
        for (int64_t b = b0; b < NB; ++b) rows<W, 1>(X, M, K, P, S, Bp, b, Y, N);
      }
    }
  });
}

// w [N, K] (float32, bfloat16 stored as int16 bits, or int8) -> [ceil(N/8), K, 8], zero-padded outputs.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: weight must be [N, K]");
  const auto t = w.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kShort || t == at::kChar, "pack: weight must be float32, int16 "
              "(bf16 bits) or int8, got ", t);
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({NB * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({NB, kLanes, K}).permute({0, 2, 1}).contiguous();  // [NB, K, 8]
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> scale,
                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "linear: x must be a float32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes, "linear: packed weight must come from pack()");
  TORCH_CHECK(packed.size(1) == x.size(1), "linear: x has K = ", x.size(1), ", the weight ", packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * kLanes && N <= packed.size(0) * kLanes, "linear: N = ", N,
              " does not match the packed weight");
  const auto t = packed.scalar_type();
  const bool has_scale = scale.has_value() && scale->defined();
  TORCH_CHECK(has_scale == (t == at::kChar), "linear: int8 weights need a per-output scale, others none");
  x = x.contiguous();
  torch::Tensor s32, b32;
  if (has_scale) {
    TORCH_CHECK(scale->numel() == N, "linear: scale has ", scale->numel(), " elements, expected ", N);
    s32 = scale->to(at::kFloat).contiguous();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " elements, expected ", N);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* S = s32.defined() ? s32.data_ptr<float>() : nullptr;
  const float* Bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  if (t == at::kFloat) {
    run<float>(X, M, K, packed.data_ptr<float>(), NB, S, Bp, Y, N);
  } else if (t == at::kShort) {
    run<uint16_t>(X, M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>()), NB, S, Bp, Y, N);
  } else {
    run<int8_t>(X, M, K, packed.data_ptr<int8_t>(), NB, S, Bp, Y, N);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] (float32, bf16 bits as int16, int8) -> packed [ceil(N/8), K, 8]");
  m.def("linear", &linear, "float32 x [M, K] @ packed weight (* scale) (+ bias) -> [M, N]");
}
