// bf16 projection y = x @ w.T (+ b) for CPU decoding, built by drafthead/kernels/cpu_linear.py.
//
// Why: oneDNN's bf16 matmul is slow at the row counts of decoding (1-5 rows: ~5 GMAC/s on the 2-core AMX
// Xeon measured, against ~28 GMAC/s here), and it changes kernels with the row count. This kernel computes
// every output element with the same instruction sequence whatever the number of rows or the row's place
// in the call, so a token verified inside a block gets the bits it gets when decoded alone.
//
// Layout: the weight [N, K] is packed once into blocks of 16 outputs; one 512-bit load holds the k-pair (2k, 2k+1)
// of a block's 16 outputs; `vdpbf16ps` adds x[2k]*w[n,2k] + x[2k+1]*w[n,2k+1] to the fp32 accumulator of each of
// the 16 outputs. Sums run over k in order, in fp32; one rounding to bf16 at the end (after adding the bias in
// fp32). No horizontal reductions. The blocks go in groups of kGroup stored side by side per k-pair
// ([K/2, 4 blocks, 16, 2] per group), so a tile over a group's blocks reads one contiguous stream instead of
// one stream per block: 10-24% less time at 2-8 rows than one block after the other, 1 row within ±10% (A/B,
// AVX512-BF16 EPYC).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // outputs per packed block
// How a tile prefetches the weight's lines ahead of its loads: the hint and the distance in k-pairs, one setting
// for weights read once a forward (a target's: `stream`) and one for the rest (a draft's). The best setting differs
// by CPU: non-temporal prefetches of a target's weights 32 k-pairs ahead won on the AVX512-BF16 EPYC (see `tile`),
// and cost the AMX Xeon ~1.8x on every row count against T0, so `kernels/probe.py` times the candidates on the
// machine and sets them (`stream_set`). The bits never depend on them.
enum Hint { kNta = 0, kT0 = 1, kT1 = 2 };
int g_hint[2] = {kT0, kNta};  // [stream]: the hint of plain and of streamed weights
int64_t g_ahead[2] = {32, 32};  // [stream]: k-pairs ahead (8 was slower at 2-8 rows than 16, 16 than 32, on the EPYC)

template <int H>
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), H == kNta ? _MM_HINT_NTA : (H == kT0 ? _MM_HINT_T0 : _MM_HINT_T1));
}
constexpr int64_t kGroup = 4;      // blocks stored side by side per k-pair (8 helped a lone row, slowed 2-8 rows)
constexpr int kRows = 6;        // rows of x per tile (6 x 4 accumulators + 4 weights + 1 broadcast = 29 zmm)
constexpr int64_t kChunk = 32;  // k-pairs per chunk when rows take several tiles (16 and 64 gained less at 7-12 rows)

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "pack: weight must be a bf16 [N, K] tensor");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack: K = ", w.size(1), " must be even");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kLanes - 1) / kLanes;
  auto padded = torch::zeros({NB * kLanes, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto blocks = padded.view({NB, kLanes, K / 2, 2}).permute({0, 2, 1, 3});  // [NB, K/2, 16, 2]
  std::vector<torch::Tensor> groups;
  for (int64_t b0 = 0; b0 < NB; b0 += kGroup)  // [K/2, width, 16, 2] each; the last group may be narrower
    groups.push_back(blocks.narrow(0, b0, std::min<int64_t>(kGroup, NB - b0)).permute({1, 0, 2, 3}).reshape({-1}));
  return torch::cat(groups).view({NB, K / 2, kLanes, 2});  // the shape of the blocks, the bytes in group order
}

// Rows m0..m0+R-1 of x against packed blocks b0..b0+B-1, over k-pairs kp0..kp1-1: the fp32 accumulators start at
// zero (first) or from acc [R][B][16] and go back there (exactly: fp32 through memory), so a call over the whole of
// K and one over K in chunks give the same bits.
// A streamed weight (read once a forward, far more bytes than the caches hold: a target's) may have its lines
// prefetched non-temporally so that they do not evict what is read again (the KV cache, activations, a draft's
// weights). A/B in one process on the AVX512-BF16 EPYC, bf16 SmolLM2 with its EAGLE3 draft, 4 MT-Bench-style
// prompts x 96 tokens x 3 rounds: AR 104.3 -> 113.4 tok/s, chain 111.2 -> 133.6 tok/s; a pass over the target's
// projections 1-7% faster at 1-16 rows. Whether a draft's weights are streamed too made no difference beyond the
// noise (16 MT-Bench prompts, three variants taking turns), so drafts keep ordinary prefetches.
// H: the prefetch hint, `ahead` k-pairs on (see g_hint). PF: prefetch ahead (a chunk's second tile finds its lines
// in L1 and does not).
template <int R, int B, int H, bool PF>
inline void tile(const at::BFloat16* x, int64_t K, const at::BFloat16* p, int64_t b0, int64_t N, int64_t m0,
                 int64_t kp0, int64_t kp1, float* acc_mem, bool first, int64_t ahead) {
  const int64_t KP = K / 2, NB = (N + kLanes - 1) / kLanes;
  const at::BFloat16* base[B];  // block b0+j's k-pair 0, and the distance to its next k-pair (its group's width)
  int64_t kstride[B];
  for (int j = 0; j < B; ++j) {
    const int64_t g0 = (b0 + j) / kGroup * kGroup;
    base[j] = p + g0 * KP * 2 * kLanes + (b0 + j - g0) * 2 * kLanes;
    kstride[j] = std::min<int64_t>(kGroup, NB - g0) * 2 * kLanes;
  }
  // The accumulators enter and leave their registers once, at constant indices: indexed at run time in a loop,
  // they may make GCC keep acc in memory and store it on every k, as it did in the fp32 kernel.
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_mem + (i * B + j) * kLanes);
  const int32_t* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = reinterpret_cast<const int32_t*>(x + (m0 + i) * K);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    if constexpr (PF) {
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j)  // one 64-byte line per block and k-pair: fetch a few pairs ahead
        prefetch<H>(base[j] + (kp + ahead) * kstride[j]);
    }
    __m512i w[B];
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) w[j] = _mm512_loadu_si512(static_cast<const void*>(base[j] + kp * kstride[j]));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i xb = _mm512_set1_epi32(xr[i][kp]);  // the pair x[2kp], x[2kp+1] in every lane
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)w[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) _mm512_store_ps(acc_mem + (i * B + j) * kLanes, acc[i][j]);
}

// y's rows m0..m0+R-1, blocks b0..b0+B-1 = acc [R][B][16] + bias, rounded once to bf16.
inline void finish(const float* acc_mem, int R, int B, const float* bias, int64_t b0, at::BFloat16* y, int64_t N,
                   int64_t m0) {
  for (int j = 0; j < B; ++j) {
    const int64_t n = (b0 + j) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bj = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_load_ps(acc_mem + (i * B + j) * kLanes);
      const __m256i o = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, bj));
      _mm256_mask_storeu_epi16(static_cast<void*>(y + (m0 + i) * N + n), mask, o);
    }
  }
}

template <int B, int H, bool PF>
inline void tile_of(int R, const at::BFloat16* x, int64_t K, const at::BFloat16* p, int64_t b0, int64_t N, int64_t m0,
                    int64_t kp0, int64_t kp1, float* acc_mem, bool first, int64_t ahead) {
  switch (R) {
    case 6: tile<6, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
    case 5: tile<5, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
    case 4: tile<4, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
    case 3: tile<3, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
    case 2: tile<2, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
    default: tile<1, B, H, PF>(x, K, p, b0, N, m0, kp0, kp1, acc_mem, first, ahead); break;
  }
}

// Blocks b0..b0+B-1 (one group, or a lone block) for every row, in tiles of up to kRows rows (a lone row: 4
// independent dot-product chains), each tile over the whole of K in turn, so the blocks come from memory once and
// from L1/L2 after; except at kRows+1 .. 2*kRows rows, where the two tiles take K in chunks of kChunk k-pairs, both
// over one chunk before the next, so the second finds the chunk's lines in L1. One tile after the other had read a
// group's lines twice from memory there (a group of SmolLM2's K = 576 is 72 KB, more than L1; the non-temporal
// prefetch keeps it out of L2). A pass over SmolLM2's projections and head at 7 / 8 rows: 8.52 / 8.52 -> 7.43 / 7.77
// ms, 1 row 7.25 / 7.35; at 16 rows chunking three tiles was slower than this (10.9-11.7 against 10.3 ms), so it
// stays with two (A/B in one process, AVX512-BF16 EPYC, 2 threads; the VM's memory read 35-41 GB/s across runs).
template <int B, int H>
inline void rows(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* p, const float* bias, int64_t b0,
                 at::BFloat16* y, int64_t N, int64_t ahead) {
  const int64_t KP = K / 2;
  alignas(64) float acc[2 * kRows * B * kLanes];
  if (M > kRows && M <= 2 * kRows) {
    const int R2 = static_cast<int>(M - kRows);
    for (int64_t k0 = 0; k0 < KP; k0 += kChunk) {
      const int64_t k1 = std::min(KP, k0 + kChunk);
      tile<kRows, B, H, true>(x, K, p, b0, N, 0, k0, k1, acc, k0 == 0, ahead);
      tile_of<B, H, false>(R2, x, K, p, b0, N, kRows, k0, k1, acc + kRows * B * kLanes, k0 == 0, ahead);
    }
    finish(acc, kRows, B, bias, b0, y, N, 0);
    finish(acc + kRows * B * kLanes, R2, B, bias, b0, y, N, kRows);
    return;
  }
  for (int64_t m = 0; m < M; m += kRows) {
    const int R = static_cast<int>(std::min<int64_t>(kRows, M - m));
    tile_of<B, H, true>(R, x, K, p, b0, N, m, 0, KP, acc, true, ahead);
    finish(acc, R, B, bias, b0, y, N, m);
  }
}

template <int H>
void run_groups(const at::BFloat16* X, int64_t M, int64_t K, const at::BFloat16* P, int64_t NB, const float* bias,
                at::BFloat16* Y, int64_t N, int64_t ahead) {
  // one contiguous run of whole groups per thread, as even as the groups allow. Work items of 8 blocks split
  // SmolLM2's 576 outputs (36 blocks, 5 items) 24 : 12 between two threads; a lone row also reads one group's
  // stream at a time (tile<1, 4>), not two. With prefetches 32 k-pairs ahead: 1 row -12%, 8 rows -6%, 16 rows -12%
  // over a pass of SmolLM2's projections and head (A/B in one process, AVX512-BF16 EPYC, 2 threads).
  const int64_t NG = (NB + kGroup - 1) / kGroup;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NG));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t be = std::min(NB, NG * (c + 1) / chunks * kGroup);
      int64_t b = NG * c / chunks * kGroup;
      for (; b + kGroup <= be; b += kGroup) rows<kGroup, H>(X, M, K, P, bias, b, Y, N, ahead);
      for (; b < be; ++b) rows<1, H>(X, M, K, P, bias, b, Y, N, ahead);  // a lone block is one latency-bound chain
    }
  });
}

// ---- AMX tiles, on CPUs that have them (where kernels/probe.py measures them faster, or `amx(True)`) -------------
// Why: on the AMX Xeon the vdpbf16ps tiles above grow linearly past 8 rows, where AMX tiles stay nearly flat to 16.
// A packed block [K/2, 16, 2] is already the layout a `tdpbf16ps` B tile reads: 16 k-pairs (rows, 64 bytes each: 16
// outputs x a bf16 pair) at the group's k-pair stride. So a tile of up to 16 rows of x (A: 32 bf16 a row) times a
// block's next 16 k-pairs adds to 16 rows x 16 outputs of fp32 (C), over K in chunks of 32 in order, then `finish`
// as above. Each C element depends on its own row of x alone and the chunks run in one order whatever the row
// count, so a row keeps its bits in any call. `tdpbf16ps` rounds differently from `vdpbf16ps`, so a weight takes
// this path for every row count or for none (K % 32 == 0; others stay on the tiles above), and the switch is one
// per process: its rows never mix the two. tests/test_cpu_linear.py checks the bits where the CPU has AMX.
constexpr int64_t kAmxK = 32;    // bf16 of x a chunk: one 64-byte A row, 16 k-pairs of B
constexpr int kAmxRows = 16;     // rows of x per A tile
bool g_amx = false;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C of blocks 0-3 (R rows x 16 fp32); 4: A (R rows x 32 bf16); 5-7: B (16 k-pairs x 16 pairs).
__attribute__((target("amx-tile"))) inline void amx_config(int R) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) { c.rows[t] = static_cast<uint8_t>(R); c.colsb[t] = 64; }
  for (int t = 5; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// Rows m0..m0+R-1 (R <= 16) against blocks b0..b0+B-1 of one group, over the whole of K (K % 32 == 0). Rows past
// 16 take another pass over the group's blocks, which T0 prefetches leave in L2 (a group of 4 blocks is 72 KB at
// K = 576): passes over K in chunks of 256, every 16-row group over a chunk before the next, were no faster at
// 17-128 rows (A/B in one process, AMX Xeon, 2 threads) and are not kept.
template <int B, int H>
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const at::BFloat16* x, int64_t K, const at::BFloat16* p,
                                                           int64_t b0, int64_t N, int64_t m0, int R, float* acc,
                                                           int64_t ahead) {
  const int64_t KP = K / 2, NB = (N + kLanes - 1) / kLanes;
  const int64_t g0 = b0 / kGroup * kGroup;
  const int64_t width = std::min<int64_t>(kGroup, NB - g0);  // blocks side by side in this group
  const at::BFloat16* base = p + g0 * KP * 2 * kLanes + (b0 - g0) * 2 * kLanes;
  const int64_t kstride = width * 2 * kLanes;  // elements from one k-pair to the next within a block
  const int64_t bstride = kstride * 2;  // bytes: a B tile's row stride
  const at::BFloat16* xa = x + m0 * K;
  amx_config(R);
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  if constexpr (B > 3) _tile_zero(3);
  for (int64_t kc = 0; kc < K; kc += kAmxK) {
    const at::BFloat16* w = base + (kc / 2) * kstride;  // k-pair kc/2 of block b0
    const char* next = reinterpret_cast<const char*>(w + ahead * kstride);  // `ahead` k-pairs on
    for (int64_t l = 0; l < 16 * bstride; l += 64) prefetch<H>(next + l);
    _tile_loadd(4, xa + kc, K * 2);
    _tile_loadd(5, w, bstride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (B > 1) { _tile_loadd(6, w + 2 * kLanes, bstride); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (B > 2) { _tile_loadd(7, w + 4 * kLanes, bstride); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (B > 3) { _tile_loadd(5, w + 6 * kLanes, bstride); _tile_dpbf16ps(3, 4, 5); }
  }
  const int64_t cstride = B * kLanes * 4;  // bytes between rows of acc [R][B][16]
  _tile_stored(0, acc, cstride);
  if constexpr (B > 1) _tile_stored(1, acc + kLanes, cstride);
  if constexpr (B > 2) _tile_stored(2, acc + 2 * kLanes, cstride);
  if constexpr (B > 3) _tile_stored(3, acc + 3 * kLanes, cstride);
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

template <int H>
void amx_groups(const at::BFloat16* X, int64_t M, int64_t K, const at::BFloat16* P, int64_t NB, const float* bias,
                at::BFloat16* Y, int64_t N, int64_t ahead) {
  static_assert(kGroup == 4, "the AMX tiles hold a group's 4 blocks in C tiles 0-3");
  const int64_t NG = (NB + kGroup - 1) / kGroup;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NG));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float acc[kAmxRows * kGroup * kLanes];
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t g = NG * c / chunks; g < NG * (c + 1) / chunks; ++g) {
        const int64_t b0 = g * kGroup;
        const int B = static_cast<int>(std::min<int64_t>(kGroup, NB - b0));
        for (int64_t m = 0; m < M; m += kAmxRows) {
          const int R = static_cast<int>(std::min<int64_t>(kAmxRows, M - m));
          switch (B) {
            case 4: amx_tile<4, H>(X, K, P, b0, N, m, R, acc, ahead); break;
            case 3: amx_tile<3, H>(X, K, P, b0, N, m, R, acc, ahead); break;
            case 2: amx_tile<2, H>(X, K, P, b0, N, m, R, acc, ahead); break;
            default: amx_tile<1, H>(X, K, P, b0, N, m, R, acc, ahead); break;
          }
          finish(acc, R, B, bias, b0, Y, N, m);
        }
      }
    }
    amx_release();  // the thread's tile state back to the kernel (cheaper context switches)
  });
}

// Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM for XTILEDATA; without it the first tile instruction
// faults) and turns the AMX path on or off. "" when done, else why not. The CPU's flags are checked in Python.
std::string amx_set(bool on) {
  if (on) {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): ") +
             std::strerror(errno);
  }
  g_amx = on;
  return "";
}

// y [M, N] = x [M, K] @ the packed weight (+ bias, fp32) on raw pointers: what `linear` runs, and what the fp32
// extension's fused decode layer calls through the capsule `LINEAR` (its small ops live there, this kernel here).
// stream: the weight is read once a forward, prefetched with the stream setting (g_hint); the bits are the same
// either way.
template <int H>
void linear_hint(const at::BFloat16* X, int64_t M, int64_t K, const at::BFloat16* P, int64_t NB, const float* bias,
                 at::BFloat16* Y, int64_t N, int64_t ahead) {
  if (g_amx && K % kAmxK == 0) amx_groups<H>(X, M, K, P, NB, bias, Y, N, ahead);
  else run_groups<H>(X, M, K, P, NB, bias, Y, N, ahead);
}

void linear_raw(const at::BFloat16* X, int64_t M, int64_t K, const at::BFloat16* P, int64_t NB, const float* bias,
                at::BFloat16* Y, int64_t N, bool stream) {
  const int64_t ahead = g_ahead[stream];
  switch (g_hint[stream]) {
    case kNta: linear_hint<kNta>(X, M, K, P, NB, bias, Y, N, ahead); break;
    case kT1: linear_hint<kT1>(X, M, K, P, NB, bias, Y, N, ahead); break;
    default: linear_hint<kT0>(X, M, K, P, NB, bias, Y, N, ahead); break;
  }
}

// Sets how plain (stream=false) and streamed weights are prefetched: hint 0 NTA, 1 T0, 2 T1; ahead in k-pairs.
void stream_set(int64_t plain_hint, int64_t plain_ahead, int64_t stream_hint, int64_t stream_ahead) {
  TORCH_CHECK(plain_hint >= 0 && plain_hint <= 2 && stream_hint >= 0 && stream_hint <= 2,
              "stream_set: hints are 0 (NTA), 1 (T0) or 2 (T1)");
  TORCH_CHECK(plain_ahead >= 1 && plain_ahead <= 1024 && stream_ahead >= 1 && stream_ahead <= 1024,
              "stream_set: ahead is 1..1024 k-pairs");
  g_hint[0] = static_cast<int>(plain_hint);
  g_hint[1] = static_cast<int>(stream_hint);
  g_ahead[0] = plain_ahead;
  g_ahead[1] = stream_ahead;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     bool stream) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "linear: x must be a bf16 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kLanes,
              "linear: packed weight must come from pack()");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "linear: x has K = ", x.size(1), ", the weight ", packed.size(1) * 2);
  TORCH_CHECK(N > (packed.size(0) - 1) * kLanes && N <= packed.size(0) * kLanes, "linear: N = ", N,
              " does not match the packed weight");
  x = x.contiguous();
  torch::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " elements, expected ", N);
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  linear_raw(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), packed.data_ptr<at::BFloat16>(), packed.size(0),
             b32.defined() ? b32.data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), N, stream);
  return y;
}

// Multiply-adds a second that `vdpbf16ps` sustains from registers alone on every thread torch runs (24 independent
// accumulators a thread, no loads): the compute side of the roofline `drafthead bench` compares a forward of n
// tokens with. A tile's loads and broadcasts come on top, so the kernel can only approach it.
double peak_macs(int64_t iters) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * kLanes);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      __m512 acc[24];
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
      __m512i w = _mm512_set1_epi32(0x3f803f80 + static_cast<int32_t>(c));  // (1, 1) in bf16, a live value
      __m512i xb = _mm512_set1_epi32(0x00010001);  // tiny values: the sums stay finite
      for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)xb, (__m512bh)w);
        __asm__ volatile("" : "+v"(w), "+v"(xb));  // not hoisted or folded
      }
      __m512 s = acc[0];
      for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
      _mm512_storeu_ps(sink.data() + c * kLanes, s);
    }
  });
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(threads) * iters * 24 * 32 / sec;  // 32 multiply-adds an instruction
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "bf16 weight [N, K] -> packed [ceil(N/16), K/2, 16, 2], blocks in groups of 4 per k-pair");
  m.def("linear", &linear, "bf16 x [M, K] @ packed weight (+ bias) -> [M, N]; stream: prefetch the weight "
        "non-temporally", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias"), py::arg("stream") = false);
  m.def("peak_macs", &peak_macs, "multiply-adds a second of vdpbf16ps from registers on torch's threads",
        py::arg("iters"));
  m.attr("GROUP") = kGroup;
  m.attr("ROWS") = kRows;
  m.def("amx_set", &amx_set, "turn the AMX tile path on (asking Linux for the tile state) or off; '' or why not");
  m.def("amx_on", []() { return g_amx; });
  m.def("stream_set", &stream_set, "prefetch hints (0 NTA, 1 T0, 2 T1) and distances (k-pairs) of plain and streamed "
        "weights", py::arg("plain_hint"), py::arg("plain_ahead"), py::arg("stream_hint"), py::arg("stream_ahead"));
  m.def("stream_get", []() { return std::vector<int64_t>{g_hint[0], g_ahead[0], g_hint[1], g_ahead[1]}; });
  // blocks side by side per k-pair: cpu_linear.concat regroups joined parts by it
  m.attr("LINEAR") = py::capsule(reinterpret_cast<void*>(&linear_raw), "drafthead.bf16_linear");
}
