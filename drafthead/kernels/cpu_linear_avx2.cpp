// The fp32 CPU decode kernels (drafthead/kernels/cpu_linear.py), on AVX2/FMA CPUs with 16-lane AVX-512 paths where
// the CPU has them: projections y = x @ w.T (+ b), the attention of generated tokens, RMSNorm, RoPE,
// SiLU-and-multiply, argmax, and a whole decoder layer in one call (`DecodeLayer`); bf16 tokens take
// AVX512-BF16 instructions where the CPU has them.
//
// Why: on CPUs without native bf16 the runtime decodes in fp32, and oneDNN's fp32 matmul at 1-16 rows streamed
// SmolLM2's weights at 4.5-6.8 GB/s on a 2-core AVX2 EPYC that reads memory at ~22 GB/s, and changed kernels
// with the row count (a verify block did not round like single steps). This kernel streams each weight once
// per call for up to kRows rows at a time and computes every output with one fixed instruction sequence, so
// a row's bits do not depend on how many rows share the call.
//
// Weights are packed once into blocks of 8 outputs: one 256-bit register holds w[n0..n0+7, k]. The blocks are
// stored in groups of 3 side by side per k ([K, 3, 8] per group), so a tile reads one contiguous stream per
// group, not one per block: 2-4 rows took 17-25% less time with fp32 storage (7-27% with bf16), 8 rows about the
// same (A/B of both builds in one process, AVX512-BF16 EPYC); a lone row also prefetches its own stream. Three storage
// types, all accumulated in fp32 over k in order (one FMA per k, no horizontal sums):
//   fp32 - the weights as they are;
//   bf16 - the upper 16 bits of each fp32 weight (round-to-nearest-even done in Python), half the bytes;
//   int8 - symmetric per-output-row quantization, a quarter of the bytes; y = scale[n] * sum_k x[k] q[n, k].
//
// On CPUs with AVX-512, 2+ rows run 16-lane tiles of up to 8 rows (`tile512`), with the same bits.
//
// Also the attention of generated tokens (`attention`, at the end; fp32 or bf16 inputs, fp32 math), row-invariant
// the same way.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // outputs per packed block
constexpr int kBlocks = 6;     // packed blocks per work item (48 outputs)
constexpr int kRows = 4;       // rows of x per tile (4 x 3 accumulators + 3 weights + 1 broadcast = 16 ymm)
constexpr int64_t kGroup = 3;  // blocks stored side by side per k: one multi-row tile's blocks
// How the projections stream their weights, set per process (`stream_set`; kernels/probe.py picks them on the
// machine, the bits never depend on them):
//   g_ahead - k a lone row (and an AVX-512 tile's first rows) prefetches ahead in its own stream into L1 (32 won
//             on the AVX512-BF16 EPYC the kernel was written on: 3-11% slower without a prefetch at 1 row);
//   g_kc    - k per chunk of the 8-lane multi-row tiles (0: the whole K). With chunks, each group's chunk of
//             weights is read by every row tile of the call while it is in L1, instead of each 4-row tile
//             streaming the whole group again from L2; the accumulators wait in memory between chunks (stored
//             and loaded exactly, so every output is still one FMA per k in order from zero: the same bits).
int64_t g_ahead = 32;
int64_t g_kc = 0;

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

// A group's lines at k + g_ahead (its k-th element at `at`, `step` bytes a k: one line, or two for fp32) into L1: a
// stream read from memory by a lone row or a tile's first rows, fetched ahead of the loads.
template <typename W>
inline void prefetch_ahead(const W* at, int64_t step) {
  const char* a = reinterpret_cast<const char*>(at) + g_ahead * step;
  _mm_prefetch(a, _MM_HINT_T0);
  if (step > 64) _mm_prefetch(a + 64, _MM_HINT_T0);
}

// The sums of rows m0..m0+R-1 and blocks b0..b0+B-1 (out [R, B, 8]) times the scale, plus the bias, into y: one
// multiply and one add per element (no FMA: -ffp-contract=off), whichever tile made the sums.
template <int R, int B>
inline void finish(const float* out, const float* scale, const float* bias, int64_t b0, float* y, int64_t N,
                   int64_t m0) {
  for (int j = 0; j < B; ++j) {
    const int64_t n = (b0 + j) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, N - n);
    const __m256i mask = tail_mask(valid);
    const __m256 sj = scale ? _mm256_maskload_ps(scale + n, mask) : _mm256_set1_ps(1.0f);
    const __m256 bj = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_load_ps(out + (i * B + j) * kLanes);
      const __m256 v = scale ? _mm256_mul_ps(a, sj) : a;
      _mm256_maskstore_ps(y + (m0 + i) * N + n, mask, bias ? _mm256_add_ps(v, bj) : v);
    }
  }
}

// Rows m0..m0+R-1 of x against packed blocks b0..b0+B-1, over k0 <= k < k1 of K.
// `ahead`: elements from this tile's group to the next work item's same group, to prefetch into L2 (0: none).
// A chunk of K (k1 - k0 < K) starts from and leaves its sums in `carry` (row m, block j of the work item at
// carry[(m * kBlocks + cj + j) * 8]); the last chunk finishes the outputs.
template <typename W, int R, int B>
inline void tile(const float* x, int64_t K, const W* p, const float* scale, const float* bias, int64_t b0,
                 float* y, int64_t N, int64_t m0, int64_t ahead = 0, int64_t k0 = 0, int64_t k1 = -1,
                 float* carry = nullptr, int64_t cj = 0) {
  if (k1 < 0) k1 = K;
  const int64_t NB = (N + kLanes - 1) / kLanes;
  const W* base[B];  // block b0+j's k = 0, and the distance to its next k (its group's width x 8)
  int64_t kstride[B];
  for (int j = 0; j < B; ++j) {
    const int64_t g0 = (b0 + j) / kGroup * kGroup;
    base[j] = p + g0 * K * kLanes + (b0 + j - g0) * kLanes;
    kstride[j] = std::min<int64_t>(kGroup, NB - g0) * kLanes;
  }
  const char* pf = ahead ? reinterpret_cast<const char*>(base[0] + ahead) : nullptr;
  const int64_t step = kstride[0] * static_cast<int64_t>(sizeof(W));  // bytes of a group per k
  __m256 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j)
      acc[i][j] = k0 > 0 ? _mm256_loadu_ps(carry + ((m0 + i) * kBlocks + cj + j) * kLanes) : _mm256_setzero_ps();
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w[B];
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) w[j] = load8(base[j] + k * kstride[j]);
    if (R == 1) {  // a lone row: its own groups, g_ahead k ahead, every 64-byte line (two per k for fp32)
#pragma GCC unroll 8
      for (int j = 0; j < B; j += kGroup) prefetch_ahead(base[j] + k * kstride[j], kstride[j] * sizeof(W));
    }
    if (pf) {  // the next work item's group, the same k, into L2
      _mm_prefetch(pf + k * step, _MM_HINT_T1);
      if (step > 64) _mm_prefetch(pf + k * step + 64, _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) acc[i][j] = _mm256_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
  if (k1 < K) {  // a chunk: the sums wait for the next one
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) _mm256_storeu_ps(carry + ((m0 + i) * kBlocks + cj + j) * kLanes, acc[i][j]);
    return;
  }
  // The accumulators leave their registers once, at constant indices. Read in the loop below (whose j is a
  // run-time index) they made GCC keep acc in memory and store every accumulator on every k: 12 stores per 12
  // FMAs, which set the speed of a multi-row tile.
  alignas(32) float out[R][B][kLanes];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) _mm256_store_ps(out[i][j], acc[i][j]);
  finish<R, B>(&out[0][0][0], scale, bias, b0, y, N, m0);
}

// Blocks b0..b0+B-1 for every row: 4-row tiles of 3 blocks; a lone row (a decode step) takes all B blocks
// at once, so B independent FMA chains hide the FMA latency (3 chains left a 1-row call latency-bound).
// With more than one row, every tile also prefetches the same blocks of the next work item into L2 (`next`):
// the row tiles after the first read their blocks from cache and only compute, and without the prefetch the
// memory sat idle while they did (8 rows cost 2.1x one row; with it 1.5x, measured on one thread).
template <typename W, int B>
inline void rows(const float* x, int64_t M, int64_t K, const W* p, const float* scale, const float* bias,
                 int64_t b0, float* y, int64_t N, bool next) {
  static_assert(B == 1 || B % 3 == 0, "B is 1 or a multiple of 3");
  constexpr int S = B == 1 ? 1 : 3;  // blocks per multi-row tile: one group
  const int64_t ahead = next ? kBlocks * K * kLanes : 0;  // full groups: the next item's group is this far on
  if (B == kBlocks && M > 1 && g_kc > 0 && g_kc < K) {  // chunks of K, each group's chunk read by every row tile
    static thread_local std::vector<float> carry_v;
    if (static_cast<int64_t>(carry_v.size()) < M * kBlocks * kLanes) carry_v.resize(M * kBlocks * kLanes);
    float* carry = carry_v.data();
    for (int64_t k0 = 0; k0 < K; k0 += g_kc) {
      const int64_t k1 = std::min(K, k0 + g_kc);
      for (int j = 0; j < B; j += S) {
        int64_t m = 0;
        for (; m + kRows <= M; m += kRows)
          tile<W, kRows, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead, k0, k1, carry, j);
        switch (M - m) {
          case 3: tile<W, 3, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead, k0, k1, carry, j); break;
          case 2: tile<W, 2, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead, k0, k1, carry, j); break;
          case 1: tile<W, 1, S>(x, K, p, scale, bias, b0 + j, y, N, m, 0, k0, k1, carry, j); break;
          default: break;
        }
      }
    }
    return;
  }
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    for (int j = 0; j < B; j += S) tile<W, kRows, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead);
  switch (M - m) {
    case 3: for (int j = 0; j < B; j += S) tile<W, 3, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead); break;
    case 2: for (int j = 0; j < B; j += S) tile<W, 2, S>(x, K, p, scale, bias, b0 + j, y, N, m, ahead); break;
    case 1: tile<W, 1, B>(x, K, p, scale, bias, b0, y, N, m); break;
    default: break;
  }
}

// ---- multi-row tiles by AVX-512, on CPUs that have it ---------------------------------------------------------
// Why: a verify block of 8 rows multiplies every weight 8 times, and in 8-lane FMAs the block cost 1.46x a
// 1-token step in fp32 on a 2-core Zen 5 (the FMAs, not the stream, set its time). Here a tile takes a whole
// work item (two groups, 48 outputs) for up to 8 rows in 16-lane FMAs: 24 accumulators, 3 weight registers, so each
// weight is read once from memory for the 8 rows instead of once per 4-row tile. Every output is still one FMA per
// k in order from zero, then the same scale and bias (`finish`): the bits equal the 8-lane tiles', and the CPU,
// never the row count, chooses the code.
#define DRAFTHEAD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
constexpr int kRows512 = 8;  // rows per AVX-512 tile: 8 x 3 accumulators + 3 weights (+ 1 broadcast) of 32 zmm

DRAFTHEAD_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DRAFTHEAD_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
DRAFTHEAD_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Rows m0..m0+R-1 against the full work item of blocks b0..b0+5: groups a (blocks b0..b0+2) and b (b0+3..b0+5),
// [K, 3, 8] each. Per k: a's first 16 outputs, b's first 16, and a's last 8 joined with b's last 8.
// lead: the item's first row tile, which reads the weights from memory; it prefetches both streams g_ahead k on.
template <typename W, int R>
DRAFTHEAD_AVX512 void tile512(const float* x, int64_t K, const W* p, const float* scale, const float* bias,
                              int64_t b0, float* y, int64_t N, int64_t m0, bool lead) {
  static_assert(kBlocks == 2 * kGroup, "an AVX-512 tile takes two full groups");
  constexpr int64_t G = kGroup * kLanes;  // elements of a group per k
  const W* a = p + b0 * K * kLanes;  // b0 is a multiple of kBlocks, so group a starts at block b0
  const W* b = a + G * K;
  const int64_t step = G * static_cast<int64_t>(sizeof(W));  // bytes of a group per k
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = 0; k < K; ++k) {
    const W* ak = a + k * G;
    const W* bk = b + k * G;
    const __m512 w0 = load16(ak);
    const __m512 w1 = load16(bk);
    const __m512 w2 = _mm512_insertf32x8(_mm512_castps256_ps512(load8(ak + 16)), load8(bk + 16), 1);
    if (lead) {
      prefetch_ahead(ak, step);
      prefetch_ahead(bk, step);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(xr[i][k]);
      acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
    }
  }
  alignas(64) float out[R][kBlocks][kLanes];  // in block order: acc 0 = blocks 0-1, 1 = 3-4, 2 = 2 and 5
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(out[i][0], acc[i][0]);
    _mm512_store_ps(out[i][3], acc[i][1]);
    _mm256_store_ps(out[i][2], _mm512_castps512_ps256(acc[i][2]));
    _mm256_store_ps(out[i][5], _mm512_extractf32x8_ps(acc[i][2], 1));
  }
  finish<R, kBlocks>(&out[0][0][0], scale, bias, b0, y, N, m0);
}

// Every row (M >= 2) against the full work item at b0, in tiles of up to kRows512 rows.
template <typename W>
DRAFTHEAD_AVX512 void rows512(const float* x, int64_t M, int64_t K, const W* p, const float* scale,
                              const float* bias, int64_t b0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRows512 <= M; m += kRows512) tile512<W, kRows512>(x, K, p, scale, bias, b0, y, N, m, m == 0);
  const bool lead = m == 0;
  switch (M - m) {
    case 7: tile512<W, 7>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 6: tile512<W, 6>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 5: tile512<W, 5>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 4: tile512<W, 4>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 3: tile512<W, 3>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 2: tile512<W, 2>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    case 1: tile512<W, 1>(x, K, p, scale, bias, b0, y, N, m, lead); break;
    default: break;
  }
}

// Whether the CPU has the AVX-512 subsets this file's AVX-512 code is built for (DRAFTHEAD_AVX512), checked once.
bool cpu_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool g_avx512_tiles = true;  // tests turn it off to run the 8-lane tiles on a CPU that has both

// Whether multi-row fp32 projections run the AVX-512 tiles: the CPU has AVX-512 and they are on.
bool avx512_tiles() { return cpu_avx512() && g_avx512_tiles; }

template <typename W>
void run(const float* X, int64_t M, int64_t K, const W* P, int64_t NB, const float* S, const float* Bp, float* Y,
         int64_t N) {
  const int64_t groups = (NB + kBlocks - 1) / kBlocks;
  const bool wide = M > 1 && avx512_tiles();  // a lone row streams at the memory's speed in 8 lanes already
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kBlocks;
      if (b0 + kBlocks <= NB && wide) {
        rows512<W>(X, M, K, P, S, Bp, b0, Y, N);
      } else if (b0 + kBlocks <= NB) {  // 8-lane tiles
        const bool next = M > 1 && g + 1 < g1 && b0 + 2 * kBlocks <= NB;  // a full next item on this thread
        rows<W, kBlocks>(X, M, K, P, S, Bp, b0, Y, N, next);
      } else {  // the last, partial item: block by block
        for (int64_t b = b0; b < NB; ++b) rows<W, 1>(X, M, K, P, S, Bp, b, Y, N, false);
      }
    }
  });
}

// Multiply-adds a second that the FMAs of the multi-row tiles sustain from registers alone on every thread torch
// runs (independent accumulators, no loads): 16-lane FMAs where the AVX-512 tiles are on, else 8-lane ones. The
// compute side of the roofline `drafthead bench` compares a forward of n tokens with.
template <typename Body>
double timed_on_threads(Body body) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) sink[c] = body(c);
  });
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(threads) / sec;
}

float fma_loop8(int64_t iters, int64_t c) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256 w = _mm256_set1_ps(0.999f), xb = _mm256_set1_ps(1e-3f + static_cast<float>(c));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(xb, w, acc[i]);
    __asm__ volatile("" : "+x"(w), "+x"(xb));  // not hoisted or folded
  }
  for (int i = 1; i < 12; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  return _mm256_cvtss_f32(acc[0]);
}

DRAFTHEAD_AVX512 float fma_loop16(int64_t iters, int64_t c) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 w = _mm512_set1_ps(0.999f), xb = _mm512_set1_ps(1e-3f + static_cast<float>(c));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(xb, w, acc[i]);
    __asm__ volatile("" : "+v"(w), "+v"(xb));
  }
  for (int i = 1; i < 24; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_cvtss_f32(acc[0]);
}

double peak_macs(int64_t iters) {
  if (avx512_tiles()) return iters * 24.0 * 16 * timed_on_threads([&](int64_t c) { return fma_loop16(iters, c); });
  return iters * 12.0 * 8 * timed_on_threads([&](int64_t c) { return fma_loop8(iters, c); });
}

// w [N, K] (float32, bfloat16 stored as int16 bits, or int8) -> [ceil(N/8), K, 8], zero-padded outputs: the shape
// of the blocks, the bytes in group order ([K, 3, 8] per group; the last group may be narrower).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: weight must be [N, K]");
  const auto t = w.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kShort || t == at::kChar, "pack: weight must be float32, int16 "
              "(bf16 bits) or int8, got ", t);
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({NB * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto blocks = padded.view({NB, kLanes, K}).permute({0, 2, 1});  // [NB, K, 8]
  std::vector<torch::Tensor> groups;
  for (int64_t b0 = 0; b0 < NB; b0 += kGroup)
    groups.push_back(blocks.narrow(0, b0, std::min<int64_t>(kGroup, NB - b0)).permute({1, 0, 2}).reshape({-1}));
  return torch::cat(groups).view({NB, K, kLanes});
}

// y [M, N] = x [M, K] @ packed (* scale) (+ bias), dispatched on the packed weight's storage (fp32, bf16 bits as
// int16, int8): what `linear` runs, and DecodeLayer's fp32 projections.
void run_packed(const float* X, int64_t M, int64_t K, const torch::Tensor& packed, const float* S, const float* Bp,
                float* Y, int64_t N) {
  const int64_t NB = packed.size(0);
  const auto t = packed.scalar_type();
  if (t == at::kFloat)
    run<float>(X, M, K, packed.data_ptr<float>(), NB, S, Bp, Y, N);
  else if (t == at::kShort)
    run<uint16_t>(X, M, K, static_cast<const uint16_t*>(packed.data_ptr()), NB, S, Bp, Y, N);
  else
    run<int8_t>(X, M, K, packed.data_ptr<int8_t>(), NB, S, Bp, Y, N);
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
  auto y = torch::empty({x.size(0), N}, x.options());
  run_packed(x.data_ptr<float>(), x.size(0), x.size(1), packed, s32.defined() ? s32.data_ptr<float>() : nullptr,
             b32.defined() ? b32.data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  return y;
}

// ---- attention of generated tokens ----------------------------------------------------------------------
// Why: per-query SDPA calls of a fixed width (what keeps torch's SDPA row-invariant on CPU) spent ~4 ms of a
// SmolLM2 decode step computing 16 queries against the whole cache capacity. Here each query is computed over
// the keys its mask allows, in key order, with one fixed instruction sequence per score and per output element:
// its bits depend on its q, the keys it sees and nothing else (not the number of queries in the call, not the
// cache capacity), and masked keys cost nothing.

// exp(x) for x <= 0 (a score minus the row's max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: 2^n stays a normal float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));  // ln2, high bits
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));    // ln2, low bits
  __m256 p = _mm256_set1_ps(1.0f / 720);
  const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  for (float ci : c) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(ci));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum8(__m256 v) {  // fixed order
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// The queries of one token that share a KV head are computed together, up to kQ at a time: each key and value
// row is read (and, for bf16, widened) once for all of them instead of once per query. A score is still the
// same instruction sequence whatever the tile: one FMA per 8 lanes over d in order, then the 8 lanes summed as
// hsum8 sums them, then the scale; so its bits depend on its q and key alone.
constexpr int kQ = 3;  // queries per tile: 3 x 4 accumulators + a key row fit the 16 ymm registers

// Scores of G queries (fp32, [G, D] at qf) with keys key[0..3]: out[g] = the 4 scores of query g, unscaled.
template <int G, typename E>
inline void dot4(const float* qf, int64_t D, const E* kb, const int64_t* key, int64_t ks, __m128* out) {
  __m256 acc[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_setzero_ps();
  const E* kr[4] = {kb + key[0] * ks, kb + key[1] * ks, kb + key[2] * ks, kb + key[3] * ks};
  for (int64_t d = 0; d < D; d += 8) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m256 kd = load8(kr[u] + d);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), kd, acc[g][u]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice gives
    // [(a0+a1)+(a2+a3), b.., c.., d.. | (a4+a5)+(a6+a7), ...]; the halves added: hsum8's order per key
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    out[g] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
}

// o_g[0 .. 8C) = inv[g] * sum_j p_g[j] v[key[j], 0 .. 8C), over j in order, one FMA per j and element, for G
// queries at once (p_g = p + g * ps, o_g = o[g]): each value row is read once for the G of them.
template <int G, int C, typename E>
inline void weighted_sum(const float* p, int64_t ps, const int64_t* key, int64_t n, const E* v, int64_t vs,
                         const float* inv, float* const* o, int64_t d0) {
  __m256 acc[G][C];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const E* vj = v + key[j] * vs + d0;
    __m256 pj[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) pj[g] = _mm256_set1_ps(p[g * ps + j]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256 vc = load8(vj + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(pj[g], vc, acc[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o[g] + d0 + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

// The key and value rows kAheadKeys keys on toward L1 (and the first ones before a tile's loop): a decode step's
// cache rows come from memory (the weights streamed since evicted them), and the hardware prefetcher alone left the
// loads waiting. A SmolLM2 forward of 1 / 3 / 8 tokens took 0.9 / 1.2 / 0.9 ms less in bf16 and 0.9 / 1.9 / 0.4 ms
// less in fp32 (8 or 32 ahead gained less than 16; A/B of both builds in one process, AVX512-BF16 EPYC).
constexpr int64_t kAheadKeys = 16;

// The 64-byte lines of one key's K row and V row toward L1.
template <typename E>
inline void prefetch_kv_row(const E* k, const E* v, int64_t lines) {
  for (int64_t l = 0; l < lines; ++l) {
    _mm_prefetch(reinterpret_cast<const char*>(k) + 64 * l, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + 64 * l, _MM_HINT_T0);
  }
}

// Prefetch the K and V rows of keys key[u0 .. u1) (clipped at n), D elements each.
template <typename E>
inline void prefetch_keys(const E* kb, int64_t ks, const E* vb, int64_t vs, const int64_t* key, int64_t n, int64_t D,
                          int64_t u0, int64_t u1) {
  const int64_t lines = (D * static_cast<int64_t>(sizeof(E)) + 63) / 64;
  for (int64_t u = u0; u < std::min(n, u1); ++u) prefetch_kv_row(kb + key[u] * ks, vb + key[u] * vs, lines);
}

// ---- bf16 attention and SiLU by AVX512-BF16, on CPUs that have it ----------------------------------------------
// Why: with the projections streaming at the memory's speed, a verify of 8 tokens still paid for its attention in
// compute: per query and key, 8 FMAs of widened bf16 and a horizontal sum for the score, 8 FMAs and 8 widenings
// for the weighted sum. `vdpbf16ps` takes the bf16 rows as stored, 32 products an instruction. The attention of
// SmolLM2's 30 layers, 8 queries on 256 cached keys: 1.41 -> 0.89 ms a forward, 1 query 0.56 -> 0.38 ms
// (A/B in one process, AVX512-BF16 EPYC). The CPU chooses the code once, never the row count, so a token still
// gets the same bits alone or in a block; the bits differ from the AVX2 code's (another summation order, and the
// weighted sum's probabilities to ~2^-17 instead of 2^-24: within 4e-6 of fp64 in the tests, against 4e-7).
#define DRAFTHEAD_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

DRAFTHEAD_AVX512_BF16 inline __m512 widen16(__m256i h) {  // 16 bf16 -> fp32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The first min(left, 16) lanes; masked loads and stores of 16 bf16; fp32 rounded to bf16 (nearest even) and back.
DRAFTHEAD_AVX512_BF16 inline __mmask16 first16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
DRAFTHEAD_AVX512_BF16 inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return widen16(_mm256_maskz_loadu_epi16(m, p));
}
DRAFTHEAD_AVX512_BF16 inline __m512 round16(__m512 v) { return widen16((__m256i)_mm512_cvtneps_pbh(v)); }
DRAFTHEAD_AVX512_BF16 inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// Scores of G bf16 queries with their keys: a score's products are summed as pairs into 16 fp32 lanes (one
// instruction per 32 elements of d, in order), and the 16 lanes then by one fixed tree, the same for each of the 4
// keys of a step; keys past the last are padded with the last key and dropped, so there is no second code path for
// a remainder.
template <int G>
DRAFTHEAD_AVX512_BF16 void scores_bf16(const uint16_t* const* qr, int64_t D, const uint16_t* kb, int64_t ks,
                                       const uint16_t* vb, int64_t vs, const int64_t* key, int64_t n, float sc,
                                       float* score, int64_t ps, float* top) {
  const int64_t nz = (D + 31) / 32;  // 512-bit vectors of 32 bf16 per row; the last one masked if D % 32
  const __mmask32 last = D % 32 ? static_cast<__mmask32>((1ull << (D % 32)) - 1) : static_cast<__mmask32>(~0u);
  constexpr int kMaxZ = 4;  // head_dim <= 128 here; longer heads take the FMA path
  __m512i q[G][kMaxZ];
  for (int g = 0; g < G; ++g)
    for (int64_t z = 0; z < nz; ++z) q[g][z] = _mm512_maskz_loadu_epi16(z + 1 < nz ? ~0u : last, qr[g] + 32 * z);
  __m128 hi[G];  // running max of each query's scores (a padded key repeats the last score: no harm)
  for (int g = 0; g < G; ++g) hi[g] = _mm_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 4) {
    prefetch_keys(kb, ks, vb, vs, key, n, D, j + kAheadKeys, j + kAheadKeys + 4);
    const uint16_t* kr[4];
    for (int u = 0; u < 4; ++u) kr[u] = kb + key[std::min(j + u, n - 1)] * ks;
    __m512 acc[G][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
    for (int64_t z = 0; z < nz; ++z) {
      const __mmask32 m = z + 1 < nz ? ~0u : last;
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i kz = _mm512_maskz_loadu_epi16(m, kr[u] + 32 * z);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][u] = _mm512_dpbf16_ps(acc[g][u], (__m512bh)q[g][z], (__m512bh)kz);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      // lanes l + l+8 (keys 0,1 in one vector, 2,3 in another), then l + l+4, then the 4 left as (0+2) + (1+3)
      const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[g][0], acc[g][1], 0x44),
                                       _mm512_shuffle_f32x4(acc[g][0], acc[g][1], 0xEE));
      const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[g][2], acc[g][3], 0x44),
                                       _mm512_shuffle_f32x4(acc[g][2], acc[g][3], 0xEE));
      const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
      const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));  // (0+2), (1+3) in lanes 0, 1 of each key
      const __m512 w = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));  // lane 0 of each 128 bits: the key's sum
      const __m128 s = _mm_mul_ps(_mm512_castps512_ps128(_mm512_permutexvar_ps(
                                      _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w)),
                                  _mm_set1_ps(sc));
      _mm_storeu_ps(score + g * ps + j, s);  // up to 3 past n: inside the row's padding
      hi[g] = _mm_max_ps(hi[g], s);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(16) float h4[4];
    _mm_store_ps(h4, hi[g]);
    top[g] = std::max(std::max(h4[0], h4[1]), std::max(h4[2], h4[3]));
  }
}

// One pass of wsum_bf16 over d0 .. d0 + 32 * NZ (fewer if `left` < that): NZ a constant, so that the accumulators
// stay in registers.
template <int G, int NZ>
DRAFTHEAD_AVX512_BF16 inline void wsum_pass(const int32_t* pp, int64_t ps, const int64_t* key, int64_t n,
                                            const uint16_t* vb, int64_t vs, const float* inv, float* const* o,
                                            int64_t d0, int64_t left, __m512i ix0, __m512i ix1) {
  __mmask32 mz[NZ];
  for (int z = 0; z < NZ; ++z) {
    const int64_t w = std::min<int64_t>(32, left - 32 * z);
    mz[z] = w == 32 ? static_cast<__mmask32>(~0u) : static_cast<__mmask32>((1u << w) - 1);
  }
  __m512 acc[G][2 * NZ];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NZ; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* vj = vb + key[j] * vs;
    __m512i vv[2 * NZ];
#pragma GCC unroll 2
    for (int z = 0; z < NZ; ++z) {
      const __m512i v = _mm512_maskz_loadu_epi16(mz[z], vj + 32 * z);
      vv[2 * z] = _mm512_unpacklo_epi16(v, v);
      vv[2 * z + 1] = _mm512_unpackhi_epi16(v, v);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m512i pb = _mm512_set1_epi32(pp[g * ps + j]);
#pragma GCC unroll 4
      for (int c = 0; c < 2 * NZ; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)pb, (__m512bh)vv[c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 2
    for (int z = 0; z < NZ; ++z) {
      const int64_t w = std::min<int64_t>(32, left - 32 * z);  // d of this chunk: 16 + 16, or fewer
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * z], ix0, acc[g][2 * z + 1]), s);
      const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * z], ix1, acc[g][2 * z + 1]), s);
      float* oz = o[g] + d0 + 32 * z;
      _mm512_mask_storeu_ps(oz, first16(w), a);
      if (w > 16) _mm512_mask_storeu_ps(oz + 16, first16(w - 16), b);
    }
  }
}

// exp(x) for x <= 0 in 16 lanes: exp8's range reduction and polynomial, by FMAs.
DRAFTHEAD_AVX512_BF16 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  for (float ci : c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ci));
  return _mm512_scalef_ps(p, n);
}

// The softmax of G score rows in 16 lanes, for wsum_bf16: e = exp(score - top) is summed per lane over the keys in
// order (the 16 lanes then by one fixed tree) and stored in place as a pair of bf16, hi = bf16(e) and
// lo = bf16(e - hi) (e to ~2^-17), to be scaled by inv = 1 / sum after the weighted sum. Why one pass in 16 lanes:
// the 8-lane softmax and a second pass that made the pairs took about a quarter of an 8-token attention (perf).
// SmolLM2's attention of 8 queries on 256 cached keys: 29.6 -> 27.1 and 33.5 -> 31.2 us a layer, 1 query 8.9 ->
// 8.8 and 13.4 -> 12.9 (A/B in one process, turns taken, two runs, AVX512-BF16 Zen 5 EPYC). New bits: the sums run
// in another order; a token still gets the same bits alone or in a block.
template <int G>
DRAFTHEAD_AVX512_BF16 void softmax_pairs(float* score, int64_t ps, int64_t n, const float* top, float* inv) {
  for (int g = 0; g < G; ++g) {
    float* sg = score + g * ps;
    const __m512 m16 = _mm512_set1_ps(top[g]);
    __m512 tot = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first16(n - j);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), m16)));
      tot = _mm512_add_ps(tot, e);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(e);
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, widen16(hi)));
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(hi), _mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16));
      _mm512_mask_storeu_epi32(sg + j, m, pair);
    }
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(tot), _mm512_extractf32x8_ps(tot, 1));
    inv[g] = 1.0f / hsum8(t8);
  }
}

// o_g = inv[g] * sum_j p_g[j] v[key[j]] for G bf16 queries: each probability comes as a pair of bf16 (softmax_pairs),
// both times the same value, so one instruction adds p * v[d] for 16 d from the value row as it is stored, in key
// order.
template <int G>
DRAFTHEAD_AVX512_BF16 void wsum_bf16(const float* p, int64_t ps, const int64_t* key, int64_t n, const uint16_t* vb,
                                     int64_t vs, const float* inv, float* const* o, int64_t D) {
  // unpacklo / unpackhi of a row with itself put (v[d], v[d]) for d = 8L + 0..3 / 8L + 4..7 in lanes 4L + 0..3 of
  // each 128-bit block L; these indices (16 + lane: the unpackhi half) put a 32-wide chunk back in d order
  const __m512i ix0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);  // d 0..15
  const __m512i ix1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);  // d 16..31
  const int32_t* pp = reinterpret_cast<const int32_t*>(p);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 64 d a pass: 2 or 4 accumulators of 16 per query
    if (D - d0 > 32) wsum_pass<G, 2>(pp, ps, key, n, vb + d0, vs, inv, o, d0, D - d0, ix0, ix1);
    else wsum_pass<G, 1>(pp, ps, key, n, vb + d0, vs, inv, o, d0, D - d0, ix0, ix1);
  }
}

bool g_avx512_bf16 = true;  // tests turn it off to run the AVX2 code on a CPU that has both

// Whether bf16 attention and elementwise ops (SiLU, norms, RoPE, adds, roundings) run their AVX512-BF16 code: the
// CPU has it (checked once) and it is on.
bool avx512_bf16() {
  static const bool has = cpu_avx512() && __builtin_cpu_supports("avx512bf16");
  return has && g_avx512_bf16;
}

// G queries of one token against its keys (key[0 .. n)) of one KV head: scores, softmax, weighted sum.
template <int G, typename E>
void attend_tile(const float* qf, const E* const* qr, int64_t D, const E* kb, int64_t ks, const E* vb, int64_t vs,
                 const int64_t* key, int64_t n, float sc, float* score, int64_t ps, float* const* o) {
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  int64_t j = 0;
  auto prefetch = [&](int64_t u0, int64_t u1) { prefetch_keys(kb, ks, vb, vs, key, n, D, u0, u1); };
  prefetch(0, kAheadKeys);  // the first rows, before the loop's reach
  const bool dot16 = std::is_same_v<E, uint16_t> && D <= 128 && avx512_bf16();
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (dot16) {
      scores_bf16<G>(qr, D, kb, ks, vb, vs, key, n, sc, score, ps, top);
      j = n;
    }
  }
  for (; j + 4 <= n; j += 4) {
    prefetch(j + kAheadKeys, j + kAheadKeys + 4);
    __m128 s[G];
    dot4<G>(qf, D, kb, key + j, ks, s);
    for (int g = 0; g < G; ++g) {
      s[g] = _mm_mul_ps(s[g], _mm_set1_ps(sc));
      _mm_storeu_ps(score + g * ps + j, s[g]);
      for (int u = 0; u < 4; ++u) top[g] = std::max(top[g], score[g * ps + j + u]);
    }
  }
  for (; j < n; ++j) {
    const E* kj = kb + key[j] * ks;
    for (int g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), load8(kj + d), acc);
      score[g * ps + j] = hsum8(acc) * sc;
      top[g] = std::max(top[g], score[g * ps + j]);
    }
  }
  float inv[G];
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (dot16) {
      softmax_pairs<G>(score, ps, n, top, inv);
      wsum_bf16<G>(score, ps, key, n, vb, vs, inv, o, D);
      return;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sg = score + g * ps;
    for (int64_t i = n; i < n + 8; ++i) sg[i] = -INFINITY;  // the last chunk's padding, zeroed below
    const __m256 m8 = _mm256_set1_ps(top[g]);
    __m256 tot = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 si = _mm256_loadu_ps(sg + i);
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(si, m8)),
                                     _mm256_cmp_ps(si, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
      _mm256_storeu_ps(sg + i, e);
      tot = _mm256_add_ps(tot, e);
    }
    inv[g] = 1.0f / hsum8(tot);
  }
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) weighted_sum<G, 4>(score, ps, key, n, vb, vs, inv, o, d0);
  switch ((D - d0) / 8) {
    case 3: weighted_sum<G, 3>(score, ps, key, n, vb, vs, inv, o, d0); break;
    case 2: weighted_sum<G, 2>(score, ps, key, n, vb, vs, inv, o, d0); break;
    case 1: weighted_sum<G, 1>(score, ps, key, n, vb, vs, inv, o, d0); break;
    default: break;
  }
}

// Where a tensor's rows are: element (i0, i1, i2, d) at base + i0 * s0 + i1 * s1 + i2 * s2 + d (rows contiguous).
struct Rows { int64_t s0, s1, s2; };

// Why: a step's K/V rows come from memory (the weights streamed since evicted them), and one thread's loop over
// its items fetched them as it went, kAheadKeys keys ahead: the attention of 1 query on 256 keys took 8.4 us a
// layer with the rows in cache and 33 us after a cache flush. Each thread now first prefetches every K and V row
// its items will read (up to kUpfrontBytes), so the loads overlap one another. A SmolLM2 bf16 forward, 1 / 8 tokens
// on 256 cached: 6.98 -> 6.71 / 8.40 -> 8.07 ms and 8.17 -> 7.89 / 9.83 -> 9.29 ms (A/B in one process, turns taken,
// AVX512-BF16 Zen 5 EPYC; the bits are the same). A T1 hint gained less than T0; issuing the prefetch at the
// layer's start, before its q/k/v projection, gained nothing more.
constexpr int64_t kUpfrontBytes = 512 << 10;  // half a Zen 4 / Zen 5 core's L2

// Prefetch the K and V rows that work items i0 .. i1 of attention_core read (each (b, KV head) once, with the keys
// visible to its first item's token; a later token's few more keys are the block's own, just written).
template <typename E>
void prefetch_items(int64_t i0, int64_t i1, const E* Kp, Rows kst, const E* Vp, Rows vst, const bool* Mp, int64_t B,
                    int64_t T, int64_t KVH, int64_t S, int64_t D, int64_t tiles) {
  std::vector<char> seen(B * KVH, 0);
  const int64_t lines = (D * static_cast<int64_t>(sizeof(E)) + 63) / 64;
  int64_t budget = kUpfrontBytes;
  for (int64_t i = i0; i < i1 && budget > 0; ++i) {
    const int64_t bt = i / (KVH * tiles), kh = (i / tiles) % KVH, b = bt / T;
    if (seen[b * KVH + kh]) continue;
    seen[b * KVH + kh] = 1;
    const bool* mi = Mp + bt * S;
    const E* kb = Kp + b * kst.s0 + kh * kst.s1;
    const E* vb = Vp + b * vst.s0 + kh * vst.s1;
    for (int64_t j = 0; j < S && budget > 0; ++j) {
      if (!mi[j]) continue;
      prefetch_kv_row(kb + j * kst.s2, vb + j * vst.s2, lines);
      budget -= 2 * lines * 64;
    }
  }
}

// ---- bf16 attention on AMX tiles, where the bf16 projections run them (kernels/probe.py's path) -----------------
// Why: with the projections on AMX tiles, a verify of 16-64 tokens spent most of its added time in the attention:
// per query and key, vdpbf16ps code pays a horizontal sum for the score and 4 instructions of 16 lanes for the
// weighted sum (SmolLM2, ~340 cached keys: 1.4 / 5.0 / 16.6 ms a forward at 1 / 16 / 64 tokens under the profiler,
// AMX Xeon). `tdpbf16ps` does 16 queries x 16 keys (scores) or 16 queries x 16 outputs (weighted sum) an
// instruction, so the queries of a request's tokens that share a KV head run as one tile over the keys they all see.
//
// Bits: every query is computed over its own keys in key order (the positions its mask allows, compacted), in
// blocks of 16 from the first, whatever the tile: a score is its row of Q against its key's column of K (D/32
// tile products from zero, in order), the softmax is softmax_pairs over the query's row, and the weighted sum adds
// the blocks in order into the query's row of C, the probabilities as (hi, lo) bf16 pairs against (v, v). A row's
// result in a tile product depends on its own A row alone, so the tile around it (other tokens, other heads) does
// not change its bits. Keys every query of a request sees (the blocks below its shortest run of visible leading
// keys: the shared prefix) run as tiles of up to 16 query rows; each token's other keys (the rest of its cache and
// its own block's, gathered) continue its rows' C from there. Past a query's last key its block is padded: zero K
// and V rows where gathered, and zero probabilities. tdpbf16ps rounds unlike vdpbf16ps, so this path is on for the
// process with the AMX projections (`amx_attention_set`) and never chosen by row count.
#define DRAFTHEAD_AMX_ATTN \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool g_amx_attention = false;
constexpr int kAttnRows = 16;  // query rows per A and C tile
constexpr int64_t kAttnMaxD = 256;  // head_dim up to this (a multiple of 32) on this path

struct alignas(64) AttnTiles {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (R rows x 16 fp32); 4: A (R rows x 32 bf16); 5-7: B (16 rows x 16 pairs).
DRAFTHEAD_AMX_ATTN inline void attn_tiles(int R) {
  AttnTiles c;
  for (int t = 0; t < 5; ++t) { c.rows[t] = static_cast<uint8_t>(R); c.colsb[t] = 64; }
  for (int t = 5; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// 16 rows of 16 dwords -> their transpose (r[i] holds row i; out[c] gets column c).
DRAFTHEAD_AMX_ATTN inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // rows 4q..4q+3: column k (mod 4) of each 128-bit lane in u[4q + k]
    u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    out[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[k + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    out[k + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[k + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// One block of 16 keys as B tiles (row pointers; a null one is a zero row). kt [D/2, 16] dwords: the k-pairs of K^T
// (row p: (k[2p], k[2p+1]) of each key), transposed 16 x 16 dwords at a time.
DRAFTHEAD_AMX_ATTN void keys_tile(const uint16_t* const* k, int64_t D, uint32_t* kt) {
  for (int64_t c = 0; c < D / 32; ++c) {  // 16 k-pairs a step
    __m512i r[16], col[16];
    for (int j = 0; j < 16; ++j) r[j] = k[j] ? _mm512_loadu_si512(k[j] + 32 * c) : _mm512_setzero_si512();
    transpose16(r, col);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (16 * c + p) * 16, col[p]);
  }
}

// vd [D/16][16 keys][16] dwords: each value twice, (v, v), against a probability's (hi, lo) pair.
DRAFTHEAD_AMX_ATTN void values_tile(const uint16_t* const* v, int64_t D, uint32_t* vd) {
  for (int64_t c = 0; c < D / 16; ++c)
    for (int j = 0; j < 16; ++j) {
      const __m256i* row = reinterpret_cast<const __m256i*>(v[j] + 16 * c);
      const __m512i w = v[j] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(row)) : _mm512_setzero_si512();
      _mm512_storeu_si512(vd + (c * 16 + j) * 16, _mm512_or_si512(w, _mm512_slli_epi32(w, 16)));
    }
}

// Scores of R query rows (qa [R, D] bf16) against one block's keys (kt): 16 unscaled fp32 a row into s (row
// stride ss floats). The tiles are configured for R rows.
DRAFTHEAD_AMX_ATTN inline void block_scores(const uint16_t* qa, int64_t D, const uint32_t* kt, float* s, int64_t ss) {
  _tile_zero(0);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, qa + 32 * c, D * 2);
    _tile_loadd(5, kt + 16 * 16 * c, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, s, ss * 4);
}

// o [R, D] fp32 (row stride D) += p [R rows, 16 pairs at each block's column] x vd of blocks 0..nb-1, in block order;
// o is loaded and stored through the C tiles, 64 outputs at a time.
DRAFTHEAD_AMX_ATTN void blocks_wsum(const int32_t* p, int64_t ps, const uint32_t* const* vd, int64_t nb, int64_t D,
                                    float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nc = std::min<int64_t>(4, (D - d0) / 16);
    _tile_loadd(0, o + d0, D * 4);
    if (nc > 1) _tile_loadd(1, o + d0 + 16, D * 4);
    if (nc > 2) _tile_loadd(2, o + d0 + 32, D * 4);
    if (nc > 3) _tile_loadd(3, o + d0 + 48, D * 4);
    for (int64_t kb = 0; kb < nb; ++kb) {
      const uint32_t* w = vd[kb] + (d0 / 16) * 256;
      _tile_loadd(4, p + 16 * kb, ps * 4);
      _tile_loadd(5, w, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nc > 1) { _tile_loadd(6, w + 256, 64); _tile_dpbf16ps(1, 4, 6); }
      if (nc > 2) { _tile_loadd(7, w + 512, 64); _tile_dpbf16ps(2, 4, 7); }
      if (nc > 3) { _tile_loadd(5, w + 768, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, o + d0, D * 4);
    if (nc > 1) _tile_stored(1, o + d0 + 16, D * 4);
    if (nc > 2) _tile_stored(2, o + d0 + 32, D * 4);
    if (nc > 3) _tile_stored(3, o + d0 + 48, D * 4);
  }
}

DRAFTHEAD_AMX_ATTN void attn_release() { _tile_release(); }

// A small buffer of a thread's that keeps its memory between calls (a fresh vector a call is zeroed again).
template <typename T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Visible keys of one query at positions from..S-1 (its mask row m) into key; returns how many.
inline int64_t visible(const bool* m, int64_t from, int64_t S, int64_t* key) {
  int64_t c = 0;
  for (int64_t j = from; j < S; ++j)
    if (m[j]) key[c++] = j;
  return c;
}

// attention_core's arguments and what attention_amx worked out from the mask, for the AMX items' functions (a
// lambda does not take a function's target attribute).
struct AttnArgs {
  const uint16_t *Q, *Kp, *Vp;
  Rows qs, kst, vst, os;
  const bool* Mp;
  int64_t T, D, KVH, S, G, per, tiles, nbmax;
  float sc;
  float* O;
  const int64_t* shared;  // [B] keys every token of request b sees, from 0, in whole blocks
  const int64_t* nb;      // [B] blocks of keys by position that request b's tile sweeps
  const int64_t* len;     // [B, T] keys each token sees
  const char* lined;      // [B, T] whether they are the first len[b, t] positions (causal rows; a tree's first path)
  uint32_t* kt;           // [B, KVH, nbmax] blocks' K^T, D/2 x 16 dwords each (null: each tile makes its own)
  uint32_t* vd;           // [B, KVH, nbmax] blocks' (v, v), D x 16 dwords each (null: each tile makes its own)
};

// Block k of request b's KV head kh by position (keys 16k .. 16k+15) as B tiles into kt and vd; rows past the
// cache are zero rows.
DRAFTHEAD_AMX_ATTN void position_block(const AttnArgs& a, int64_t b, int64_t kh, int64_t k, const uint16_t* zero,
                                       uint32_t* kt, uint32_t* vd) {
  const uint16_t* kb = a.Kp + b * a.kst.s0 + kh * a.kst.s1;
  const uint16_t* vb = a.Vp + b * a.vst.s0 + kh * a.vst.s1;
  const uint16_t* kr[16];
  const uint16_t* vr[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t at = 16 * k + j;
    kr[j] = at < a.S ? kb + at * a.kst.s2 : zero;
    vr[j] = at < a.S ? vb + at * a.vst.s2 : zero;
  }
  keys_tile(kr, a.D, kt);
  values_tile(vr, a.D, vd);
}

// Blocks i0 .. i1 of (request, KV head, block by position) into the call's shared buffers.
DRAFTHEAD_AMX_ATTN void attention_amx_blocks(const AttnArgs& a, const uint16_t* zero, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / (a.KVH * a.nbmax), kh = (i / a.nbmax) % a.KVH, k = i % a.nbmax;
    if (k < a.nb[b]) position_block(a, b, kh, k, zero, a.kt + i * a.D / 2 * 16, a.vd + i * a.D * 16);
  }
}

// Work items i0 .. i1 of attention_amx: (request, KV head, tile of `per` tokens).
DRAFTHEAD_AMX_ATTN void attention_amx_items(const AttnArgs& a, const uint16_t* zero, int64_t i0, int64_t i1) {
  const int64_t T = a.T, D = a.D, KVH = a.KVH, S = a.S, G = a.G, per = a.per, tiles = a.tiles;
  const bool* Mp = a.Mp;
  const float sc = a.sc;
  static thread_local std::vector<float> score_v, tail_v, acc_v;
  static thread_local std::vector<uint32_t> kt_v;
  static thread_local std::vector<uint16_t> qa_v;
  static thread_local std::vector<int64_t> key_v;
  const int64_t ps = (S + 15) / 16 * 16 + 16;  // a query's score / probability row
  float* score = scratch(score_v, kAttnRows * ps);
  float* tail = scratch(tail_v, kAttnRows * ps);  // a gathered token's probabilities past the shared blocks
  float* acc = scratch(acc_v, kAttnRows * D);
  uint32_t* kt = scratch(kt_v, D / 2 * 16);  // a gathered block's K^T
  // blocks' (v, v) made here, then a gathered token's: S x D x 8 bytes, so per call (kept a thread's, it would hold
  // megabytes for the life of the process after one long batch)
  const std::unique_ptr<uint32_t[]> vd_p(new uint32_t[2 * ((S + 15) / 16 + 1) * D * 16]);
  uint32_t* vd = vd_p.get();
  uint32_t* gvd = vd + ((S + 15) / 16 + 1) * D * 16;
  uint16_t* qa = scratch(qa_v, kAttnRows * D);
  int64_t* key = scratch(key_v, S);
  float inv[kAttnRows];
  int64_t n[kAttnRows];
  const uint16_t* kr[16];
  const uint16_t* vr[16];
  std::vector<const uint32_t*> vds((S + 15) / 16 + 1);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / (KVH * tiles), kh = (i / tiles) % KVH, t0 = (i % tiles) * per;
    const int64_t nt = std::min(per, T - t0), R = nt * G, P0 = a.shared[b], nb = a.nb[b];
    const uint16_t* kb = a.Kp + b * a.kst.s0 + kh * a.kst.s1;
    const uint16_t* vb = a.Vp + b * a.vst.s0 + kh * a.vst.s1;
    const uint32_t* bvd = a.vd ? a.vd + (b * KVH + kh) * a.nbmax * D * 16 : vd;
    for (int64_t r = 0; r < R; ++r)  // row r: token t0 + r / G, head kh * G + r % G
      std::memcpy(qa + r * D, a.Q + b * a.qs.s0 + (kh * G + r % G) * a.qs.s1 + (t0 + r / G) * a.qs.s2, D * 2);
    // every row's scores against the blocks by position (made here when one tile takes all of the request's tokens)
    attn_tiles(static_cast<int>(R));
    for (int64_t k = 0; k < nb; ++k) {
      const uint32_t* bkt = kt;
      if (a.kt) bkt = a.kt + ((b * KVH + kh) * a.nbmax + k) * D / 2 * 16;
      else position_block(a, b, kh, k, zero, kt, vd + k * D * 16);
      block_scores(qa, D, bkt, score + 16 * k, ps);
    }
    // a token whose keys are not its first positions: its own keys past the shared blocks, gathered
    attn_tiles(static_cast<int>(G));
    for (int64_t u = 0; u < nt; ++u) {
      n[u] = a.len[b * T + t0 + u];
      if (a.lined[b * T + t0 + u]) continue;
      const int64_t c = visible(Mp + (b * T + t0 + u) * S, P0, S, key);
      for (int64_t k = 0; 16 * k < c; ++k) {
        for (int j = 0; j < 16; ++j) kr[j] = 16 * k + j < c ? kb + key[16 * k + j] * a.kst.s2 : zero;
        keys_tile(kr, D, kt);
        block_scores(qa + u * G * D, D, kt, score + u * G * ps + P0 + 16 * k, ps);
      }
    }
    // each row's softmax over its keys; zero probabilities past them (to the sweep's last block), and a gathered
    // token's own probabilities moved out of the sweep's way
    for (int64_t r = 0; r < R; ++r) {
      float* row = score + r * ps;
      const int64_t len = n[r / G];
      __m512 hi = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = first16(len - j);
        const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, row + j), _mm512_set1_ps(sc));
        _mm512_mask_storeu_ps(row + j, mk, s);
        hi = _mm512_mask_max_ps(hi, mk, hi, s);
      }
      float top = len > 0 ? _mm512_reduce_max_ps(hi) : 0.0f;
      softmax_pairs<1>(row, ps, len, &top, &inv[r]);
      int32_t* pr = reinterpret_cast<int32_t*>(row);
      const int64_t end = std::max(16 * nb, (len + 15) / 16 * 16);
      for (int64_t j = len; j < end; ++j) pr[j] = 0;
      if (!a.lined[b * T + t0 + r / G]) {
        std::memcpy(tail + r * ps, pr + P0, ((len + 15) / 16 * 16 - P0) * 4);
        for (int64_t j = P0; j < 16 * nb; ++j) pr[j] = 0;
      }
    }
    // the weighted sum: every row over the blocks by position, then a gathered token's own blocks on its rows
    std::fill(acc, acc + R * D, 0.0f);
    for (int64_t k = 0; k < nb; ++k) vds[k] = bvd + k * D * 16;
    attn_tiles(static_cast<int>(R));
    if (nb > 0) blocks_wsum(reinterpret_cast<const int32_t*>(score), ps, vds.data(), nb, D, acc);
    attn_tiles(static_cast<int>(G));
    for (int64_t u = 0; u < nt; ++u) {
      if (a.lined[b * T + t0 + u]) continue;
      const int64_t c = visible(Mp + (b * T + t0 + u) * S, P0, S, key), nbt = (c + 15) / 16;
      for (int64_t k = 0; k < nbt; ++k) {
        for (int j = 0; j < 16; ++j) vr[j] = 16 * k + j < c ? vb + key[16 * k + j] * a.vst.s2 : zero;
        vds[k] = gvd + k * D * 16;
        values_tile(vr, D, gvd + k * D * 16);
      }
      if (nbt > 0)
        blocks_wsum(reinterpret_cast<const int32_t*>(tail + u * G * ps), ps, vds.data(), nbt, D, acc + u * G * D);
    }
    for (int64_t r = 0; r < R; ++r) {  // a query that sees no key gets zeros, as masked-out rows
      float* o = a.O + b * a.os.s0 + (kh * G + r % G) * a.os.s1 + (t0 + r / G) * a.os.s2;
      const __m512 s = _mm512_set1_ps(n[r / G] > 0 ? inv[r] : 0.0f);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), s));
    }
  }
  attn_release();
}

// attention_core's bf16 queries on AMX tiles (see above); same arguments. G = H / KVH <= 16, D % 32 == 0.
// A token whose keys are its first positions (every causal row) runs every block in its tile by position, with
// zero probabilities past its last key: its row's C does not change there, so the blocks it shares with the
// other tokens and the cache slots past its keys (finite values, zero weight) give the bits it gets alone.
void attention_amx(const uint16_t* Q, Rows qs, const uint16_t* Kp, Rows kst, const uint16_t* Vp, Rows vst,
                   const bool* Mp, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S, float sc,
                   float* O, Rows os) {
  const int64_t G = H / KVH, per = kAttnRows / G;  // tokens per tile (a token's heads never straddle two)
  std::vector<int64_t> shared(B, S), nb(B, 0), len(B * T);
  std::vector<char> lined(B * T);
  int64_t nbmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const bool* m = Mp + (b * T + t) * S;
      int64_t lead = 0, count = 0;
      while (lead < S && m[lead]) ++lead;
      count = lead;
      for (int64_t j = lead; j < S; ++j) count += m[j];
      len[b * T + t] = count;
      lined[b * T + t] = count == lead;
      shared[b] = std::min(shared[b], lead);
      if (count == lead) nb[b] = std::max(nb[b], (count + 15) / 16);
    }
    shared[b] = shared[b] / 16 * 16;
    nb[b] = std::max(nb[b], shared[b] / 16);
    nbmax = std::max(nbmax, nb[b]);
  }
  static thread_local std::vector<uint16_t> zero_v;
  if (zero_v.size() < static_cast<size_t>(D)) zero_v.assign(D, 0);
  // blocks made once for the tiles of a request when it has several (a verify of more than `per` tokens); else by
  // the one tile that reads them, without a second parallel region (a decode step). B x KVH x S x D x 6 bytes: per
  // call, for the same reason as the items' (v, v)
  const int64_t tiles = (T + per - 1) / per;
  const bool apart = tiles > 1;
  const std::unique_ptr<uint32_t[]> kt_p(apart ? new uint32_t[B * KVH * nbmax * D / 2 * 16] : nullptr);
  const std::unique_ptr<uint32_t[]> vd_p(apart ? new uint32_t[B * KVH * nbmax * D * 16] : nullptr);
  const AttnArgs a{Q, Kp, Vp, qs, kst, vst, os, Mp, T, D, KVH, S, G, per, tiles, nbmax, sc, O,
                   shared.data(), nb.data(), len.data(), lined.data(), kt_p.get(), vd_p.get()};
  const uint16_t* zero = zero_v.data();
  if (apart)
    at::parallel_for(0, B * KVH * nbmax, 4, [&](int64_t i0, int64_t i1) { attention_amx_blocks(a, zero, i0, i1); });
  at::parallel_for(0, B * KVH * a.tiles, 1, [&](int64_t i0, int64_t i1) { attention_amx_items(a, zero, i0, i1); });
}

// Whether bf16 attention of G heads a KV head and head_dim D runs on AMX tiles: the process turned them on with the
// AMX projections, and the shape fits the tiles.
bool amx_attention(int64_t G, int64_t D) {
  return g_amx_attention && avx512_bf16() && D % 32 == 0 && D <= kAttnMaxD && G <= kAttnRows;
}

// Asks Linux for the AMX tile state (as the bf16 extension does for its projections) and turns the AMX attention on
// or off. "" when done, else why not.
std::string amx_attention_set(bool on) {
  if (on) {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): ") +
             std::strerror(errno);
  }
  g_amx_attention = on;
  return "";
}

// q [B, H, T, D] (rows at Q, strides qs over b, h, t); k, v [B, KVH, S, D]; mask [B, T, S] bool, contiguous;
// -> fp32 o [B, H, T, D] (rows at O, strides os over b, h, t). E: float (fp32 tokens) or uint16_t (bf16 bits:
// bf16 tokens, widened exactly; the math is fp32 either way).
template <typename E>
void attention_core(const E* Q, Rows qs, const E* Kp, Rows kst, const E* Vp, Rows vst, const bool* Mp, int64_t B,
                    int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S, float sc, float* O, Rows os) {
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (amx_attention(H / KVH, D)) {
      attention_amx(Q, qs, Kp, kst, Vp, vst, Mp, B, H, T, D, KVH, S, sc, O, os);
      return;
    }
  }
  const int64_t group = H / KVH;
  // work items: (b, t, KV head, tile of up to kQ of the heads sharing it). A lone SmolLM2 step has only 3 such
  // items for 2 threads and still takes less time than 9 one-query items (7.3 against ~14 us, AVX512-BF16).
  const int64_t tiles = (group + kQ - 1) / kQ;
  at::parallel_for(0, B * T * KVH * tiles, 1, [&](int64_t i0, int64_t i1) {
    const int64_t ps = S + 8;  // one query's score row (+ the padding of its last chunk of 8)
    std::vector<float> score(kQ * ps), qf(kQ * D);
    std::vector<int64_t> key(S);
    prefetch_items<E>(i0, i1, Kp, kst, Vp, vst, Mp, B, T, KVH, S, D, tiles);
    int64_t scanned = -1, n = 0;  // the (b, t) whose visible keys are in key[0 .. n)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bt = i / (KVH * tiles), kh = (i / tiles) % KVH, h0 = kh * group + (i % tiles) * kQ;
      const int64_t b = bt / T, t = bt % T, G = std::min<int64_t>(kQ, kh * group + group - h0);
      if (bt != scanned) {
        const bool* mi = Mp + bt * S;
        n = 0;
        for (int64_t j = 0; j < S; ++j)
          if (mi[j]) key[n++] = j;
        scanned = bt;
      }
      float* og[kQ];
      const E* qr[kQ];
      for (int64_t g = 0; g < G; ++g) {
        qr[g] = Q + b * qs.s0 + (h0 + g) * qs.s1 + t * qs.s2;
        og[g] = O + b * os.s0 + (h0 + g) * os.s1 + t * os.s2;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(qf.data() + g * D + d, load8(qr[g] + d));
      }
      if (n == 0) {  // a query that sees no key (never in the runtime): zeros, as masked-out rows
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) og[g][d] = 0.0f;
        continue;
      }
      const E* kb = Kp + b * kst.s0 + kh * kst.s1;
      const E* vb = Vp + b * vst.s0 + kh * vst.s1;
      switch (G) {
        case 3: attend_tile<3>(qf.data(), qr, D, kb, kst.s2, vb, vst.s2, key.data(), n, sc, score.data(), ps, og);
          break;
        case 2: attend_tile<2>(qf.data(), qr, D, kb, kst.s2, vb, vst.s2, key.data(), n, sc, score.data(), ps, og);
          break;
        default: attend_tile<1>(qf.data(), qr, D, kb, kst.s2, vb, vst.s2, key.data(), n, sc, score.data(), ps, og);
          break;
      }
    }
  });
}

// q [B, H, T, D]; k, v [B, KVH, S, D] (any strides but the last); mask [B, 1, T, S] bool -> fp32 [B, H, T, D].
template <typename E>
torch::Tensor attention_impl(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "attention: 4-d q, k, v, mask");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(D % 8 == 0, "attention: head_dim must be a multiple of 8, got ", D);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && v.sizes() == k.sizes() && H % KVH == 0,
              "attention: k and v must be [B, KVH, S, D] with KVH dividing q's heads");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v rows must be contiguous");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == B && mask.size(2) == T && mask.size(3) == S,
              "attention: mask must be a bool [B, 1, T, S]");
  q = q.contiguous();
  mask = mask.contiguous();
  auto o = torch::empty(q.sizes(), q.options().dtype(at::kFloat));
  const Rows rows_q{H * T * D, T * D, D};  // q and o: contiguous [B, H, T, D]
  attention_core<E>(static_cast<const E*>(q.data_ptr()), rows_q, static_cast<const E*>(k.data_ptr()),
                    Rows{k.stride(0), k.stride(1), k.stride(2)}, static_cast<const E*>(v.data_ptr()),
                    Rows{v.stride(0), v.stride(1), v.stride(2)}, mask.data_ptr<bool>(), B, H, T, D, KVH, S,
                    static_cast<float>(scale), o.data_ptr<float>(), rows_q);
  return o;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  const auto t = q.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && k.scalar_type() == t && v.scalar_type() == t,
              "attention: q, k, v must all be float32 or all bfloat16");
  return t == at::kFloat ? attention_impl<float>(q, k, v, mask, scale) : attention_impl<uint16_t>(q, k, v, mask, scale);
}

// ---- the small ops of a generated token's decoder layer -------------------------------------------------
// Why: RMSNorm, RoPE and SiLU-and-multiply are a few dozen elements per head or row at decode time, and as torch
// ops they cost their dispatch: F.rms_norm alone ran as ~8 operators (~23 us a call under the profiler) and a
// layer's small ops outnumbered its projections 5 to 1. Each is one call here, computed row by row in plain
// loops with a fixed order (a row's bits do not depend on the number of rows), in fp32, rounded to the input
// dtype where torch's decode path rounds (HF's bf16 rounding points: normalized x, then times the weight).

// E = float or uint16_t (bf16 bits). Values move as fp32; round_s / round8 give the fp32 value of the rounding to
// E (bf16: c10's round to nearest even, NaN kept a NaN; round8 is its 8-lane twin), so results round exactly where
// torch's ops round.
inline float to_f(float v) { return v; }
inline float to_f(uint16_t v) { return c10::detail::f32_from_bits(v); }
template <typename E> inline float round_s(float v);
template <> inline float round_s<float>(float v) { return v; }
template <> inline float round_s<uint16_t>(float v) { return to_f(c10::detail::round_to_nearest_even(v)); }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = c10::detail::round_to_nearest_even(v); }  // exact: v already rounded

template <typename E> inline __m256 round8(__m256 v);
template <> inline __m256 round8<float>(__m256 v) { return v; }
template <> inline __m256 round8<uint16_t>(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16),
                                                                                     _mm256_set1_epi32(1)));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(b, bias), _mm256_set1_epi32(-65536)));
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {  // v already rounded: its high halves
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// ---- a bf16 layer's elementwise ops in 16 lanes, on CPUs with AVX512-BF16 ----------------------------------------
// The same math and the same roundings as their 8-lane code, 16 lanes at a time, rounding by `vcvtneps2bf16`
// (nearest even, as round8) instead of round8's seven integer steps. It reads a subnormal input as zero where
// round8 keeps it; a product there needs values near 1e-38, which these layers' activations do not come near (the
// tests compare the bits with torch's ops). The CPU chooses the code once, never the row count. A SmolLM2 bf16
// forward's norms, RoPE, adds and rounding at 8 tokens: 0.30-0.36 -> 0.22-0.33 ms (phase timers, two runs each,
// AVX512-BF16 Zen 5 EPYC); the logits' bits are the same.

// y = bf16(w * bf16(x * r)): rms_norm's second pass.
DRAFTHEAD_AVX512_BF16 void norm_scale_bf16(const uint16_t* x, const uint16_t* w, float r, uint16_t* y, int64_t H) {
  const __m512 r16 = _mm512_set1_ps(r);
  for (int64_t h = 0; h < H; h += 16) {
    const __mmask16 m = first16(H - h);
    store16(y + h, m, _mm512_mul_ps(load16(w + h, m), round16(_mm512_mul_ps(load16(x + h, m), r16))));
  }
}

// y = bf16(a + b).
DRAFTHEAD_AVX512_BF16 void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first16(n - i);
    store16(y + i, m, _mm512_add_ps(load16(a + i, m), load16(b + i, m)));
  }
}

// y = bf16(x) of fp32 x.
DRAFTHEAD_AVX512_BF16 void round_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first16(n - i);
    store16(y + i, m, _mm512_maskz_loadu_ps(m, x + i));
  }
}

// rope_row<uint16_t, uint16_t>: each product and the sum rounded to bf16.
DRAFTHEAD_AVX512_BF16 void rope_bf16(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* y,
                                     int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 16) {
    const __mmask16 m = first16(half - d);
    const __m512 x1 = load16(x + d, m), x2 = load16(x + half + d, m);
    const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(x1, load16(c + d, m))),
                                    round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(s + d, m))));
    const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + half + d, m))),
                                    round16(_mm512_mul_ps(x1, load16(s + half + d, m))));
    store16(y + d, m, lo);
    store16(y + half + d, m, hi);
  }
}

template <typename E>
void rms_norm_impl(const E* X, const E* W, E* Y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const E* xr = X + m * H;
    E* yr = Y + m * H;
    __m256 acc = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      const __m256 v = load8(xr + h);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; h < H; ++h) ss += to_f(xr[h]) * to_f(xr[h]);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    if constexpr (std::is_same_v<E, uint16_t>) {
      if (avx512_bf16()) {
        norm_scale_bf16(xr, W, r, yr, H);
        continue;
      }
    }
    const __m256 r8 = _mm256_set1_ps(r);
    for (h = 0; h + 8 <= H; h += 8)
      store8(yr + h, round8<E>(_mm256_mul_ps(load8(W + h), round8<E>(_mm256_mul_ps(load8(xr + h), r8)))));
    for (; h < H; ++h) put(yr + h, round_s<E>(to_f(W[h]) * round_s<E>(to_f(xr[h]) * r)));
  }
}

// x [..., H] -> weight * normalize(x) over the last dim, the dtype of x (float32 or bfloat16, weight alike).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const auto t = x.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && w.scalar_type() == t,
              "rms_norm: x and weight must both be float32 or both bfloat16");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight must be [H] with H = x's last dim");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty_like(x);
  const int64_t H = x.size(-1), M = x.numel() / H;
  if (t == at::kFloat)
    rms_norm_impl<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, H, eps);
  else
    rms_norm_impl<uint16_t>(static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint16_t*>(w.data_ptr()),
                            static_cast<uint16_t*>(y.data_ptr()), M, H, eps);
  return y;
}

// One head's row: y = x * cos + rotate_half(x) * sin, each product and the sum rounded to E (as torch's ops).
// C, the type of cos and sin, sets where the math rounds: C = E rounds each product and the sum to E (HF's
// `x * cos + rotate_half(x) * sin` in E); C = float with bf16 x keeps them in fp32 and rounds once to E (a draft's
// rope: x widened, fp32 tables, `.to(x.dtype)` at the end).
template <typename E, typename C = E>
inline void rope_row(const E* x, const C* c, const C* s, E* y, int64_t D) {
  if constexpr (std::is_same_v<E, uint16_t> && std::is_same_v<C, uint16_t>) {
    if (avx512_bf16()) return rope_bf16(x, c, s, y, D);
  }
  const int64_t half = D / 2;
  int64_t d = 0;
  if (half % 8 == 0)
    for (; d < half; d += 8) {
      const __m256 x1 = load8(x + d), x2 = load8(x + half + d);
      const __m256 lo = _mm256_add_ps(round8<C>(_mm256_mul_ps(x1, load8(c + d))),
                                      round8<C>(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), load8(s + d))));
      const __m256 hi = _mm256_add_ps(round8<C>(_mm256_mul_ps(x2, load8(c + half + d))),
                                      round8<C>(_mm256_mul_ps(x1, load8(s + half + d))));
      store8(y + d, round8<E>(round8<C>(lo)));
      store8(y + half + d, round8<E>(round8<C>(hi)));
    }
  for (; d < half; ++d) {
    const float x1 = to_f(x[d]), x2 = to_f(x[half + d]);
    put(y + d, round_s<E>(round_s<C>(round_s<C>(x1 * to_f(c[d])) + round_s<C>(-x2 * to_f(s[d])))));
    put(y + half + d, round_s<E>(round_s<C>(round_s<C>(x2 * to_f(c[half + d])) + round_s<C>(x1 * to_f(s[half + d])))));
  }
}

// x [B, T, heads, D] (last dim contiguous; a slice of the joined q/k/v output), cos, sin [B, T, D] or [B, 1, T, D]
// (the runtime's shape, squeezed here rather than by two Python slices a layer) -> rotate-half
// RoPE as HF Llama, contiguous [B, T, heads, D], x's dtype.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const auto t = x.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && cos.scalar_type() == t && sin.scalar_type() == t,
              "rope: x, cos and sin must all be float32 or all bfloat16");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, "rope: x must be [B, T, heads, D] with "
              "contiguous rows and D even");
  if (cos.dim() == 4 && cos.size(1) == 1 && sin.dim() == 4 && sin.size(1) == 1) {  // the runtime's [B, 1, T, D]
    cos = cos.squeeze(1);
    sin = sin.squeeze(1);
  }
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == x.size(1) && cos.size(2) == x.size(3)
              && sin.sizes() == cos.sizes(), "rope: cos and sin must be [B, T, D] or [B, 1, T, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t B = x.size(0), S = x.size(1), NH = x.size(2), D = x.size(3);
  const int64_t es = t == at::kFloat ? 4 : 2;
  const char* X = static_cast<const char*>(x.data_ptr());
  const char* C = static_cast<const char*>(cos.data_ptr());
  const char* Sn = static_cast<const char*>(sin.data_ptr());
  char* Y = static_cast<char*>(y.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i)
      for (int64_t n = 0; n < NH; ++n) {
        const char* xr = X + (b * x.stride(0) + i * x.stride(1) + n * x.stride(2)) * es;
        const char* c = C + (b * S + i) * D * es;
        const char* s = Sn + (b * S + i) * D * es;
        char* yr = Y + ((b * S + i) * NH + n) * D * es;
        if (t == at::kFloat)
          rope_row<float>(reinterpret_cast<const float*>(xr), reinterpret_cast<const float*>(c),
                          reinterpret_cast<const float*>(s), reinterpret_cast<float*>(yr), D);
        else
          rope_row<uint16_t>(reinterpret_cast<const uint16_t*>(xr), reinterpret_cast<const uint16_t*>(c),
                             reinterpret_cast<const uint16_t*>(s), reinterpret_cast<uint16_t*>(yr), D);
      }
  return y;
}

// silu(g) = g / (1 + e^-g), through e = exp(-|g|) <= 1 (exp8's range): g >= 0: g / (1 + e); g < 0: g e / (1 + e).
inline __m256 silu8(__m256 g) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);  // |g|
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);  // the sign bit of g picks g * e
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// silu(g) * up of one bf16 row in 16 lanes, for CPUs with AVX512-BF16 (chosen by the CPU, never by the row count):
// silu8's formula with exp16, rounded twice by `vcvtneps2bf16` as torch's two ops round. It gave torch's bits on
// 6.1 M random elements, as silu8 does, in 8 rows of SmolLM2's 1536 0.30 -> 0.13 ms per 30 calls (1 row: 0.09 ->
// 0.05; AVX512-BF16 EPYC). The conversion flushes subnormal values to zero, which torch's rounding keeps: a silu
// output there needs a gate below about -87, which the exp clamp already bends.
DRAFTHEAD_AVX512_BF16 void silu_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = first16(I - i);
    const __m512 gv = load16(g + i, m), uv = load16(u + i, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    const __m512 num = _mm512_mask_mul_ps(gv, _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ), gv, e);
    store16(y + i, m, _mm512_mul_ps(round16(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e))), uv));
  }
}

template <typename E>
void silu_mul_impl(const E* G, E* Y, int64_t M, int64_t I) {
  // rows split over the threads once there are a few (elementwise: a row's bits do not depend on it): 8 rows of
  // SmolLM2's 1536 took 15.2 us on one thread, 9.0 on two; a lone row (2.7 us either way) stays on one
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(I, 1)), [&](int64_t m0, int64_t m1) {
    alignas(32) float tail[8];
    for (int64_t m = m0; m < m1; ++m) {
      const E* g = G + m * 2 * I;
      const E* u = g + I;
      E* y = Y + m * I;
      if constexpr (std::is_same_v<E, uint16_t>) {
        if (avx512_bf16()) {
          silu_mul_bf16(g, u, y, I);
          continue;
        }
      }
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)  // silu(g) rounded, times up rounded: torch's two ops
        store8(y + i, round8<E>(_mm256_mul_ps(round8<E>(silu8(load8(g + i))), load8(u + i))));
      if (i < I) {  // the last I % 8: through a padded buffer, the same lane math
        for (int j = 0; j < 8; ++j) tail[j] = i + j < I ? to_f(g[i + j]) : 0.0f;
        _mm256_store_ps(tail, round8<E>(silu8(_mm256_load_ps(tail))));
        for (int64_t j = 0; i + j < I; ++j) put(y + i + j, round_s<E>(tail[j] * to_f(u[i + j])));
      }
    }
  });
}

// gu [..., 2I] = [gate | up] (the joined gate/up output) -> silu(gate) * up [..., I], gu's dtype.
torch::Tensor silu_mul(torch::Tensor gu) {
  const auto t = gu.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "silu_mul: input must be float32 or bfloat16");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "silu_mul: the last dim must be [gate | up], even");
  gu = gu.contiguous();
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / (2 * I);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  auto y = torch::empty(shape, gu.options());
  if (t == at::kFloat)
    silu_mul_impl<float>(gu.data_ptr<float>(), y.data_ptr<float>(), M, I);
  else
    silu_mul_impl<uint16_t>(static_cast<const uint16_t*>(gu.data_ptr()), static_cast<uint16_t*>(y.data_ptr()), M, I);
  return y;
}

// ---- argmax of logits rows ------------------------------------------------------------------------------
// Why: torch's CPU argmax scanned a bf16 row of SmolLM2's 49152 logits in ~180 us (40 us widened to fp32 first),
// against 5.5 us here (AVX512-BF16 EPYC); greedy decoding takes one per step and a verify one per node.
// torch.argmax's answer: the index of the first largest value, a NaN counting as the largest.
template <typename E>
int64_t argmax_row(const E* x, int64_t N) {
  __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= N; i += 8) {
    const __m256 v = load8(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  float top = -INFINITY;
  for (float v : lanes) top = std::max(top, v);
  for (int64_t j = i; j < N; ++j) {
    const float v = to_f(x[j]);
    if (v != v) any_nan = true; else top = std::max(top, v);
  }
  if (any_nan) {  // the first NaN (lanes with a NaN made `top` meaningless)
    for (int64_t j = 0; j < N; ++j)
      if (to_f(x[j]) != to_f(x[j])) return j;
  }
  const __m256 t8 = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= N; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), t8, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < N; ++i)
    if (to_f(x[i]) == top) return i;
  return 0;  // not reached: top is one of the values
}

// x [..., N] float32 or bf16 -> int64 [...], the index of each row's first largest value.
torch::Tensor argmax(torch::Tensor x) {
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "argmax: x must be float32 or bfloat16");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax: x must have a non-empty last dim");
  x = x.contiguous();
  const int64_t N = x.size(-1), M = x.numel() / N;
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto y = torch::empty(shape, x.options().dtype(at::kLong));
  int64_t* Y = y.data_ptr<int64_t>();
  const void* X = x.data_ptr();
  at::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) {  // grain 2: a lone row stays on the calling thread
    for (int64_t m = m0; m < m1; ++m)
      Y[m] = t == at::kFloat ? argmax_row(static_cast<const float*>(X) + m * N, N)
                             : argmax_row(static_cast<const uint16_t*>(X) + m * N, N);
  });
  return y;
}

// ---- a generated token's whole decoder layer in one call --------------------------------------------------
// Why: between the kernels, a SmolLM2 decode step spent ~3.7 ms of its ~13 ms (bf16, AVX512-BF16 EPYC; measured
// with the projections' outputs replayed from memory) in Python and torch dispatch: views, splits, transposes,
// KV slice writes, dtype casts and residual adds, ~25 torch calls a layer. Here one call runs a Llama / Qwen2 /
// Qwen3 layer for generated tokens: RMSNorm, the joined q/k/v projection, (q/k norms,) RoPE written straight into
// the KV cache, attention, o, the residual, RMSNorm, the joined gate/up, SiLU-and-multiply, down, the residual.
// It calls the same functions in the same order as the per-op path (TargetModel.block with these ops), so a
// token gets the same bits either way; bf16 projections run the AVX512-BF16 extension's kernel, reached
// through the function pointer that extension exports (capsule "drafthead.bf16_linear").

using Bf16Linear = void (*)(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t, const float*,
                            at::BFloat16*, int64_t, bool);
using ProjArgs = std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>;

struct Proj {  // a packed projection: packed weight, outputs, scale (int8 storage only), fp32 bias or undefined
  torch::Tensor packed, scale, bias;
  int64_t N = 0, K = 0;
};

Proj make_proj(const ProjArgs& a, const char* name) {
  Proj p;
  p.packed = std::get<0>(a);
  p.N = std::get<1>(a);
  TORCH_CHECK(p.packed.dim() == 3 || p.packed.dim() == 4, "DecodeLayer: ", name, " is not a packed weight");
  p.K = p.packed.dim() == 3 ? p.packed.size(1) : p.packed.size(1) * 2;
  TORCH_CHECK(p.N > 0 && p.N <= p.packed.size(0) * p.packed.size(2), "DecodeLayer: ", name, " has N = ", p.N,
              ", more than its packed weight holds");
  if (std::get<2>(a).has_value() && std::get<2>(a)->defined()) p.scale = std::get<2>(a)->to(at::kFloat).contiguous();
  if (std::get<3>(a).has_value() && std::get<3>(a)->defined()) p.bias = std::get<3>(a)->to(at::kFloat).contiguous();
  TORCH_CHECK(!p.bias.defined() || p.bias.numel() == p.N, "DecodeLayer: ", name, "'s bias has ", p.bias.numel(),
              " elements, expected ", p.N);
  TORCH_CHECK(p.scale.defined() == (p.packed.scalar_type() == at::kChar), "DecodeLayer: ", name,
              ": int8 weights need a per-output scale, others none");
  return p;
}

template <typename E>
void add_rows(const E* a, const E* b, E* y, int64_t n) {  // y = a + b rounded to E, as torch's add
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (avx512_bf16()) return add_bf16(a, b, y, n);
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, round8<E>(_mm256_add_ps(load8(a + i), load8(b + i))));
  for (; i < n; ++i) put(y + i, round_s<E>(to_f(a[i]) + to_f(b[i])));
}

class DecodeLayer {
 public:
  DecodeLayer(int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling,
              c10::optional<torch::Tensor> in_norm, double in_eps, torch::Tensor post_norm, double post_eps,
              c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double qk_eps, ProjArgs qkv,
              ProjArgs o, ProjArgs gate_up, ProjArgs down, py::object bf16_linear, bool stream_weights)
      : layer_(layer), H_(heads), KVH_(kv_heads), D_(head_dim), scale_(static_cast<float>(scaling)),
        in_eps_(static_cast<float>(in_eps)), post_eps_(static_cast<float>(post_eps)),
        qk_eps_(static_cast<float>(qk_eps)), post_norm_(post_norm.contiguous()),
        qkv_(make_proj(qkv, "qkv")), o_(make_proj(o, "o")), gate_up_(make_proj(gate_up, "gate_up")),
        down_(make_proj(down, "down")), stream_(stream_weights) {
    dtype_ = post_norm_.scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "DecodeLayer: float32 or bfloat16 layers only");
    hidden_ = post_norm_.numel();
    if (in_norm.has_value() && in_norm->defined()) {
      in_norm_ = in_norm->contiguous();
      TORCH_CHECK(in_norm_.scalar_type() == dtype_, "DecodeLayer: the norms must share the layer's dtype");
      TORCH_CHECK(in_norm_.numel() == hidden_, "DecodeLayer: the two norms differ in size");
    }
    TORCH_CHECK(D_ % 8 == 0 && H_ % KVH_ == 0, "DecodeLayer: head_dim a multiple of 8, kv heads dividing heads");
    // without an input norm the caller gives the attention's input itself (`forward_input`), of any width
    TORCH_CHECK(qkv_.N == (H_ + 2 * KVH_) * D_ && (!in_norm_.defined() || qkv_.K == hidden_) && o_.N == hidden_ &&
                o_.K == H_ * D_ && gate_up_.K == hidden_ && gate_up_.N % 2 == 0 && down_.K == gate_up_.N / 2 &&
                down_.N == hidden_,
                "DecodeLayer: the projections' shapes do not make one layer");
    if (q_norm.has_value() && q_norm->defined()) {
      TORCH_CHECK(k_norm.has_value() && k_norm->defined(), "DecodeLayer: q_norm without k_norm");
      q_norm_ = q_norm->contiguous();
      k_norm_ = k_norm->contiguous();
      TORCH_CHECK(q_norm_.numel() == D_ && k_norm_.numel() == D_ && q_norm_.scalar_type() == dtype_ &&
                  k_norm_.scalar_type() == dtype_, "DecodeLayer: q/k norms must be [head_dim] of the layer's dtype");
    }
    const bool bf16 = dtype_ == at::kBFloat16;
    for (const Proj* p : {&qkv_, &o_, &gate_up_, &down_})
      TORCH_CHECK(bf16 ? p->packed.dim() == 4 && p->packed.scalar_type() == at::kBFloat16 : p->packed.dim() == 3,
                  "DecodeLayer: a ", bf16 ? "bf16" : "float32", " layer needs weights packed by its dtype's kernel");
    if (bf16) {
      TORCH_CHECK(!bf16_linear.is_none(), "DecodeLayer: bf16 layers need the bf16 extension's LINEAR capsule");
      auto cap = bf16_linear.cast<py::capsule>();
      TORCH_CHECK(cap.name() != nullptr && std::string(cap.name()) == "drafthead.bf16_linear",
                  "DecodeLayer: the capsule is not drafthead.bf16_linear");
      bf16_ = reinterpret_cast<Bf16Linear>(cap.get_pointer());
    }
  }

  // h [B, T, hidden] -> the layer's output [B, T, hidden]; writes the tokens' K/V at slots [B, T] of cache
  // [B, C, S, D] (this layer's keys are channels 2 * layer * kv_heads.., its values the next kv_heads).
  // cos, sin [B, T, D] (or [B, 1, T, D]); mask [B, 1, T, S] bool.
  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor cache,
                        torch::Tensor slots, torch::Tensor mask) {
    TORCH_CHECK(in_norm_.defined(), "DecodeLayer: a layer made without an input norm runs by forward_input");
    TORCH_CHECK(h.dim() == 3 && h.size(2) == hidden_ && h.scalar_type() == dtype_,
                "DecodeLayer: h must be [B, T, ", hidden_, "] of the layer's dtype");
    return run(torch::Tensor(), h, cos, sin, cache, slots, mask);
  }

  // The layer from the attention's input on: x [B, T, qkv's K] goes straight into q/k/v (the caller normed it) and
  // the attention's output is added to residual [B, T, hidden]. An EAGLE3 layer reads [norm(embedding); norm(hidden)]
  // this way. cos, sin may also be float32 for a bf16 layer: RoPE then rounds once, after fp32 math.
  torch::Tensor forward_input(torch::Tensor x, torch::Tensor residual, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor cache, torch::Tensor slots, torch::Tensor mask) {
    TORCH_CHECK(residual.dim() == 3 && residual.size(2) == hidden_ && residual.scalar_type() == dtype_,
                "DecodeLayer: residual must be [B, T, ", hidden_, "] of the layer's dtype");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == residual.size(0) && x.size(1) == residual.size(1) &&
                x.size(2) == qkv_.K && x.scalar_type() == dtype_,
                "DecodeLayer: x must be [B, T, ", qkv_.K, "] of the layer's dtype");
    return run(x.contiguous(), residual, cos, sin, cache, slots, mask);
  }

 private:
  // x undefined: x = the input norm of h (`forward`)
  torch::Tensor run(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor cache,
                    torch::Tensor slots, torch::Tensor mask) {
    const int64_t B = h.size(0), T = h.size(1);
    if (cos.dim() == 4 && cos.size(1) == 1) cos = cos.squeeze(1);
    if (sin.dim() == 4 && sin.size(1) == 1) sin = sin.squeeze(1);
    const bool cos32 = cos.scalar_type() == at::kFloat && dtype_ != at::kFloat;  // a draft's fp32 tables
    TORCH_CHECK(cos.dim() == 3 && cos.size(0) == B && cos.size(1) == T && cos.size(2) == D_ &&
                sin.sizes() == cos.sizes() && (cos.scalar_type() == dtype_ || cos32) &&
                sin.scalar_type() == cos.scalar_type(),
                "DecodeLayer: cos and sin must be [B, T, head_dim] of the layer's dtype (or float32)");
    TORCH_CHECK(cache.dim() == 4 && cache.size(0) == B && cache.size(1) >= 2 * (layer_ + 1) * KVH_ &&
                cache.size(3) == D_ && cache.scalar_type() == dtype_ && cache.is_contiguous(),
                "DecodeLayer: cache must be a contiguous [B, L * 2 * kv_heads, S, head_dim] of the layer's dtype");
    const int64_t S = cache.size(2);
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == B && slots.size(1) == T,
                "DecodeLayer: slots must be int64 [B, T]");
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
                mask.size(2) == T && mask.size(3) == S, "DecodeLayer: mask must be a bool [B, 1, T, S]");
    h = h.contiguous();
    cos = cos.contiguous();
    sin = sin.contiguous();
    slots = slots.contiguous();
    mask = mask.contiguous();
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * T; ++i)
      TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "DecodeLayer: slot ", sl[i], " is outside the cache (capacity ", S, ")");
    if (dtype_ == at::kFloat) return step<float, float>(x, h, cos, sin, cache, sl, mask);
    if (cos32) return step<uint16_t, float>(x, h, cos, sin, cache, sl, mask);
    return step<uint16_t, uint16_t>(x, h, cos, sin, cache, sl, mask);
  }

  template <typename E>
  static E* ptr(torch::Tensor& t) { return static_cast<E*>(t.data_ptr()); }

  template <typename E>
  void project(const Proj& p, const E* x, int64_t M, E* y) const {
    const float* bias = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
    if constexpr (std::is_same_v<E, uint16_t>)
      bf16_(reinterpret_cast<const at::BFloat16*>(x), M, p.K, static_cast<const at::BFloat16*>(p.packed.data_ptr()),
            p.packed.size(0), bias, reinterpret_cast<at::BFloat16*>(y), p.N, stream_);
    else
      run_packed(x, M, p.K, p.packed, p.scale.defined() ? p.scale.data_ptr<float>() : nullptr, bias, y, p.N);
  }

  template <typename E, typename Cs>
  torch::Tensor step(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor cache,
                     const int64_t* sl, torch::Tensor mask) {
    const int64_t B = h.size(0), T = h.size(1), M = B * T, Hd = hidden_, D = D_;
    const int64_t Dq = H_ * D, Dk = KVH_ * D, Nqkv = qkv_.N, I = gate_up_.N / 2;
    const int64_t C = cache.size(1), S = cache.size(2);
    // The layer's intermediates live in one workspace reused from call to call; only the output is a new tensor.
    // Nine torch::empty a layer had cost a SmolLM2 bf16 forward 0.12-0.13 ms at 1 token and 0.04-0.18 ms at 8
    // (A/B in one process, AVX512-BF16 Zen 5 EPYC).
    const int64_t es = sizeof(E);
    enum { kQKV, kQ_, kX, kO32, kA, kY, kXN, kGU, kACT, kParts };
    const int64_t bytes[kParts] = {M * Nqkv * es, M * Dq * es, M * Hd * es, M * Dq * 4, M * Dq * es, M * Hd * es,
                                   M * Hd * es, M * 2 * I * es, M * I * es};
    int64_t need = 64;  // + the alignment of the first part
    for (int64_t b : bytes) need += (b + 63) / 64 * 64;  // each part on its own cache lines
    thread_local std::vector<char> ws;  // the GIL makes calls sequential; thread_local keeps that assumption out
    if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
    char* part[kParts];
    part[0] = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) / 64 * 64);
    for (int k = 1; k < kParts; ++k) part[k] = part[k - 1] + (bytes[k - 1] + 63) / 64 * 64;
    E* QKV = reinterpret_cast<E*>(part[kQKV]);  // [M, Nqkv]
    E* Q = reinterpret_cast<E*>(part[kQ_]);  // [B, T, h, D] after RoPE
    E* X = reinterpret_cast<E*>(part[kX]);  // [M, Hd] the input norm's output
    float* O32 = reinterpret_cast<float*>(part[kO32]);  // [B, T, h, D] attention's fp32 output
    E* A = reinterpret_cast<E*>(part[kA]);  // [M, Dq] rounded to bf16
    E* Y = reinterpret_cast<E*>(part[kY]);  // [M, Hd] o's output, then down's
    E* XN = reinterpret_cast<E*>(part[kXN]);  // [M, Hd]
    E* GU = reinterpret_cast<E*>(part[kGU]);  // [M, 2I]
    E* ACT = reinterpret_cast<E*>(part[kACT]);  // [M, I]
    const E* hp = ptr<E>(h);
    const E* xp = X;
    if (x.defined()) xp = ptr<E>(x);
    else rms_norm_impl<E>(hp, ptr<E>(in_norm_), X, M, Hd, in_eps_);
    project<E>(qkv_, xp, M, QKV);
    if (q_norm_.defined())  // Qwen3: per-head RMSNorm before RoPE, in place (each element read before written)
      for (int64_t m = 0; m < M; ++m) {
        E* row = QKV + m * Nqkv;
        rms_norm_impl<E>(row, ptr<E>(q_norm_), row, H_, D, qk_eps_);
        rms_norm_impl<E>(row + Dq, ptr<E>(k_norm_), row + Dq, KVH_, D, qk_eps_);
      }
    E* Kc = ptr<E>(cache) + 2 * layer_ * KVH_ * S * D;  // [B, kvh, S, D] at channel stride S * D
    E* Vc = Kc + KVH_ * S * D;
    const Cs* cp = ptr<Cs>(cos);
    const Cs* sp = ptr<Cs>(sin);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / T, slot = sl[m];
      const E* row = QKV + m * Nqkv;
      const Cs* c = cp + m * D;
      const Cs* s = sp + m * D;
      for (int64_t n = 0; n < H_; ++n) rope_row<E, Cs>(row + n * D, c, s, Q + (m * H_ + n) * D, D);
      for (int64_t n = 0; n < KVH_; ++n) {
        const int64_t at = ((b * C) + n) * S * D + slot * D;  // channel n of this layer's keys / values
        rope_row<E, Cs>(row + Dq + n * D, c, s, Kc + at, D);
        std::memcpy(Vc + at, row + Dq + Dk + n * D, D * sizeof(E));
      }
    }
    const Rows rows_q{T * H_ * D, D, H_ * D};  // q and o: [B, T, h, D], read as [B, h, T, D]
    const Rows rows_kv{C * S * D, S * D, D};
    attention_core<E>(Q, rows_q, Kc, rows_kv, Vc, rows_kv, mask.data_ptr<bool>(), B, H_, T, D, KVH_, S, scale_,
                      O32, rows_q);
    const E* a = reinterpret_cast<const E*>(O32);  // attention's fp32 output, rounded once to the dtype
    if constexpr (std::is_same_v<E, uint16_t>) {
      if (avx512_bf16()) round_bf16(O32, A, M * Dq);
      else for (int64_t i = 0; i < M * Dq; i += 8) store8(A + i, round8<E>(_mm256_loadu_ps(O32 + i)));  // Dq % 8 == 0
      a = A;
    }
    project<E>(o_, a, M, Y);
    auto h1 = torch::empty({M, Hd}, h.options());
    add_rows<E>(hp, Y, ptr<E>(h1), M * Hd);
    rms_norm_impl<E>(ptr<E>(h1), ptr<E>(post_norm_), XN, M, Hd, post_eps_);
    project<E>(gate_up_, XN, M, GU);
    silu_mul_impl<E>(GU, ACT, M, I);
    project<E>(down_, ACT, M, Y);
    add_rows<E>(ptr<E>(h1), Y, ptr<E>(h1), M * Hd);  // in place: elementwise
    return h1.view({B, T, Hd});
  }

  int64_t layer_, H_, KVH_, D_, hidden_ = 0;
  float scale_, in_eps_, post_eps_, qk_eps_;
  torch::Tensor in_norm_, post_norm_, q_norm_, k_norm_;
  Proj qkv_, o_, gate_up_, down_;
  at::ScalarType dtype_;
  Bf16Linear bf16_ = nullptr;
  bool stream_ = false;  // the bf16 kernel prefetches the weights non-temporally (a target's: read once a forward)
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] (float32, bf16 bits as int16, int8) -> packed [ceil(N/8), K, 8], blocks in "
        "groups of 3 per k");
  m.def("linear", &linear, "float32 x [M, K] @ packed weight (* scale) (+ bias) -> [M, N]");
  m.def("peak_macs", &peak_macs, "multiply-adds a second of the multi-row tiles' FMAs from registers on torch's "
        "threads", py::arg("iters"));
  m.attr("GROUP") = kGroup;  // blocks side by side per k: cpu_linear.concat regroups joined parts by it
  m.def("rms_norm", &rms_norm, "x [..., H], weight [H], eps -> weight * x / rms(x), row by row, x's dtype");
  m.def("rope", &rope, "x [B, T, heads, D], cos, sin [B, T, D] or [B, 1, T, D] -> rotate-half RoPE, contiguous "
        "[B, T, heads, D]");
  m.def("silu_mul", &silu_mul, "[..., 2I] = [gate | up] -> silu(gate) * up [..., I]");
  m.def("avx512_bf16", [](c10::optional<bool> on) {
    if (on.has_value()) g_avx512_bf16 = *on;
    return avx512_bf16();
  }, "whether bf16 attention and elementwise ops run their AVX512-BF16 code (the CPU has it and it is on); on: turn it on / "
        "off (tests)", py::arg("on") = py::none());
  m.def("stream_set", [](int64_t ahead, int64_t kc) {
    TORCH_CHECK(ahead >= 1 && ahead <= 1024 && kc >= 0, "stream_set: ahead 1..1024 k, kc >= 0 k (0: whole K)");
    g_ahead = ahead;
    g_kc = kc;
  }, "how the projections stream weights: k a lone row prefetches ahead, k per chunk of multi-row tiles (0: whole K)",
        py::arg("ahead"), py::arg("kc"));
  m.def("stream_get", []() { return std::make_tuple(g_ahead, g_kc); }, "(ahead, kc) as stream_set takes them");
  m.def("avx512_tiles", [](c10::optional<bool> on) {
    if (on.has_value()) g_avx512_tiles = *on;
    return avx512_tiles();
  }, "whether multi-row projections run the AVX-512 tiles (the CPU has AVX-512 and they are on); on: turn them on / "
        "off (tests)", py::arg("on") = py::none());
  m.def("amx_attention_set", &amx_attention_set, "turn the bf16 attention's AMX tiles on / off; \"\" or why not");
  m.def("amx_attention_on", []() { return g_amx_attention; }, "whether the bf16 attention runs AMX tiles");
  m.def("attention", &attention, "float32 or bf16 q [B, H, T, D], k, v [B, KVH, S, D], bool mask [B, 1, T, S], "
        "scale -> float32 [B, H, T, D], each query over the keys its mask allows, row-invariant");
  m.def("argmax", &argmax, "float32 or bf16 x [..., N] -> int64 [...], the first largest value's index (torch.argmax's)");
  py::class_<DecodeLayer>(m, "DecodeLayer", "a generated token's whole Llama / Qwen2 / Qwen3 decoder layer, one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, c10::optional<torch::Tensor>, double, torch::Tensor,
                    double, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, double, ProjArgs, ProjArgs,
                    ProjArgs, ProjArgs, py::object, bool>())
      .def("forward", &DecodeLayer::forward, "h [B, T, hidden], cos, sin, cache, slots [B, T], mask -> [B, T, hidden]")
      .def("forward_input", &DecodeLayer::forward_input, "x [B, T, qkv's K] (the attention's input), residual "
           "[B, T, hidden], cos, sin, cache, slots [B, T], mask -> [B, T, hidden]");
}
