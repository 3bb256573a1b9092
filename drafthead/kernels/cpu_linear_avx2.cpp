// fp32 projections y = x @ w.T (+ b) and attention for CPU decoding on AVX2/FMA CPUs (drafthead/kernels/cpu_linear.py).
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
//
// Also the attention of generated tokens (`attention`, at the end; fp32 or bf16 inputs, fp32 math), row-invariant
// the same way.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

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
                 float* y, int64_t N, int64_t m0, const W* pf = nullptr) {
  const int64_t block = K * kLanes;
  __m256 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = x + (m0 + i) * K;
  const W* pb = p + b0 * block;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[B];
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) w[j] = load8(pb + j * block + k * kLanes);
    if (pf && (k & 1) == 0)  // a 64-byte line of each next block per two k (fp32; compressed lines are asked twice+)
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * block + k * kLanes), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) acc[i][j] = _mm256_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
  // The accumulators leave their registers once, at constant indices. Read in the loop below (whose j is a
  // run-time index) they made GCC keep acc in memory and store every accumulator on every k: 12 stores per 12
  // FMAs, which set the speed of a multi-row tile.
  alignas(32) float out[R][B][kLanes];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) _mm256_store_ps(out[i][j], acc[i][j]);
  for (int j = 0; j < B; ++j) {
    const int64_t n = (b0 + j) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, N - n);
    const __m256i mask = tail_mask(valid);
    const __m256 sj = scale ? _mm256_maskload_ps(scale + n, mask) : _mm256_set1_ps(1.0f);
    const __m256 bj = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_load_ps(out[i][j]);
      const __m256 v = scale ? _mm256_mul_ps(a, sj) : a;
      _mm256_maskstore_ps(y + (m0 + i) * N + n, mask, bias ? _mm256_add_ps(v, bj) : v);
    }
  }
}

// Blocks b0..b0+B-1 for every row: 4-row tiles of 3 blocks; a lone row (a decode step) takes all B blocks
// at once, so B independent FMA chains hide the FMA latency (3 chains left a 1-row call latency-bound).
// With more than one row, every tile also prefetches the same blocks of the next work item (`next`) into L2:
// the row tiles after the first read their blocks from cache and only compute, and without the prefetch the
// memory sat idle while they did (8 rows cost 2.1x one row; with it 1.5x, near the FMA limit).
template <typename W, int B>
inline void rows(const float* x, int64_t M, int64_t K, const W* p, const float* scale, const float* bias,
                 int64_t b0, float* y, int64_t N, const W* next) {
  static_assert(B == 1 || B % 3 == 0, "B is 1 or a multiple of 3");
  constexpr int S = B == 1 ? 1 : 3;  // blocks per multi-row tile
  const int64_t block = K * kLanes;
  auto pf = [&](int j) -> const W* { return next ? next + j * block : nullptr; };
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    for (int j = 0; j < B; j += S) tile<W, kRows, S>(x, K, p, scale, bias, b0 + j, y, N, m, pf(j));
  switch (M - m) {
    case 3: for (int j = 0; j < B; j += S) tile<W, 3, S>(x, K, p, scale, bias, b0 + j, y, N, m, pf(j)); break;
    case 2: for (int j = 0; j < B; j += S) tile<W, 2, S>(x, K, p, scale, bias, b0 + j, y, N, m, pf(j)); break;
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
        const W* next = M > 1 && g + 1 < g1 && b0 + 2 * kBlocks <= NB ? P + (b0 + kBlocks) * K * kLanes : nullptr;
        rows<W, kBlocks>(X, M, K, P, S, Bp, b0, Y, N, next);
      } else {
        for (int64_t b = b0; b < NB; ++b) rows<W, 1>(X, M, K, P, S, Bp, b, Y, N, nullptr);
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

// ---- attention of generated tokens ----------------------------------------------------------------------
// Why: per-query SDPA calls of a fixed width (what keeps torch's SDPA row-invariant on CPU) spent ~4 ms of a
// SmolLM2 decode step computing 16 queries against the whole cache capacity. Here each query is computed on
// its own, over the keys its mask allows, in key order: its bits depend on its q, the keys it sees and nothing
// else (not the number of queries in the call, not the cache capacity), and masked keys cost nothing.

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

// The dot products of q with keys key[0..7]: each over d in order (one FMA per 8 lanes), its 8 lanes summed in
// hsum8's order ((0+1)+(2+3))+((4+5)+(6+7)) by the hadd tree below, so a key gets the bits it gets alone.
template <typename E>
inline __m256 dot8(const E* q, const E* kb, const int64_t* key, int64_t ks, int64_t D) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qd = load8(q + d);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qd, load8(kb + key[u] * ks + d), acc[u]);
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  // t0 = [(a0+a1)+(a2+a3), b.., c.., d.. | (a4+a5)+(a6+a7), ...]: add the halves
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// o[0 .. 8C) = inv * sum_j p[j] v[key[j], 0 .. 8C), over j in order, one FMA per j and element. The C chunks of 8
// are independent chains side by side (one chain per chunk in turn waited on the FMA latency at every key).
template <int C, typename E>
inline void weighted_sum(const float* p, const int64_t* key, int64_t n, const E* v, int64_t vs, float inv, float* o) {
  __m256 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const E* vj = v + key[j] * vs;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pj, load8(vj + 8 * c), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
}

// q [B, H, T, D]; k, v [B, KVH, S, D] (any strides but the last); mask [B, 1, T, S] bool -> fp32 [B, H, T, D].
// E: float (fp32 tokens) or uint16_t (bf16 bits: bf16 tokens, widened exactly; the math is fp32 either way).
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
  const E* Q = static_cast<const E*>(q.data_ptr());
  const E* Kp = static_cast<const E*>(k.data_ptr());
  const E* Vp = static_cast<const E*>(v.data_ptr());
  const bool* Mp = mask.data_ptr<bool>();
  float* O = o.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t group = H / KVH;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score(S + 8);
    std::vector<int64_t> key(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T, kh = h / group;
      const E* qi = Q + i * D;
      const bool* mi = Mp + (b * T + t) * S;
      const E* kb = Kp + b * ks0 + kh * ks1;
      const E* vb = Vp + b * vs0 + kh * vs1;
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j)
        if (mi[j]) key[n++] = j;
      float top = -INFINITY;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {  // 8 keys side by side: 8 independent chains, one reduction for all 8
        const __m256 s = _mm256_mul_ps(dot8(qi, kb, key.data() + j, ks2, D), _mm256_set1_ps(sc));
        _mm256_storeu_ps(score.data() + j, s);
        alignas(32) float t[8];
        _mm256_store_ps(t, s);
        for (float v : t) top = std::max(top, v);
      }
      for (; j < n; ++j) {
        const E* kj = kb + key[j] * ks2;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(load8(qi + d), load8(kj + d), acc);
        score[j] = hsum8(acc) * sc;
        top = std::max(top, score[j]);
      }
      float* oi = O + i * D;
      if (n == 0) {  // a query that sees no key (never in the runtime): zeros, as masked-out rows
        for (int64_t d = 0; d < D; ++d) oi[d] = 0.0f;
        continue;
      }
      for (int64_t j = n; j < n + 8; ++j) score[j] = -INFINITY;  // the last chunk's padding, zeroed below
      const __m256 m8 = _mm256_set1_ps(top);
      __m256 tot = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; j += 8) {
        const __m256 sj = _mm256_loadu_ps(score.data() + j);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sj, m8)),
                                       _mm256_cmp_ps(sj, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        _mm256_storeu_ps(score.data() + j, e);
        tot = _mm256_add_ps(tot, e);
      }
      const float inv = 1.0f / hsum8(tot);
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        switch (std::min<int64_t>(64, D - d0) / 8) {
          case 8: weighted_sum<8>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 7: weighted_sum<7>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 6: weighted_sum<6>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 5: weighted_sum<5>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 4: weighted_sum<4>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 3: weighted_sum<3>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          case 2: weighted_sum<2>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
          default: weighted_sum<1>(score.data(), key.data(), n, vb + d0, vs2, inv, oi + d0); break;
        }
      }
    }
  });
  return o;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  const auto t = q.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && k.scalar_type() == t && v.scalar_type() == t,
              "attention: q, k, v must all be float32 or all bfloat16");
  return t == at::kFloat ? attention_impl<float>(q, k, v, mask, scale) : attention_impl<uint16_t>(q, k, v, mask, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] (float32, bf16 bits as int16, int8) -> packed [ceil(N/8), K, 8]");
  m.def("linear", &linear, "float32 x [M, K] @ packed weight (* scale) (+ bias) -> [M, N]");
  m.def("attention", &attention, "float32 or bf16 q [B, H, T, D], k, v [B, KVH, S, D], bool mask [B, 1, T, S], "
        "scale -> float32 [B, H, T, D], each query on its own over the keys its mask allows");
}
