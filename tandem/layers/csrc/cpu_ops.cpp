// tandem's CPU kernels: the small per-layer operations of a forward step, each fused into one pass over its data.
//
// On a CPU a decode step of a small model is bound by the count of operations, not by arithmetic: every torch op
// costs microseconds of dispatch and its own pass over memory. These kernels replace ~20 ops per layer with four:
//   add_rms_norm   x += delta; h = rms_norm(x) * w          (residual add, norm and cast in one pass)
//   qk_rms_norm    Qwen3's per-head norms of q and k         (both in one pass, out of the fused QKV's view)
//   rope_write_kv  rotate q and k, store k and v in the paged cache
//   paged_attention  causal attention of few queries per request read straight from the paged cache (no gather)
//   silu_mul       silu(gate) * up
// and the projections themselves (AVX512-BF16; on AVX2 / FMA CPUs the bf16 weights widened to float32 in registers):
//   linear_bf16    y = x @ W^T (+ bias) over a VNNI-packed weight
// and one for sampling:
//   greedy_tokens  each row's argmax among the tokens its grammar bitmask allows
// Registered as torch ops (`torch.ops.tandem.*`); built on first use by `tandem/runner/kernels.py`.
// Layouts: one layer's KV cache is [2, KVH, num_blocks, block_size * D] in the model dtype, slot = block * block_size +
// offset; a V block is [block_size, D], a K block is stored transposed, [D, block_size] (see paged_attention). Blocks
// are contiguous; heads and blocks may be strided (the runner stores a block of all heads together, [2, NB, KVH, ...],
// so the first writes to a cache on huge pages commit one page per layer, not one per head).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "float_types.h"

namespace {

using at::Tensor;

using tandem_kernels::dispatch_float;

// Loads and stores between a storage type and float32, written so that loops over them vectorise (bf16 <-> f32 is a
// 16-bit shift; the store rounds to nearest-even as torch does and keeps NaN quiet).
inline float bf16_to_float(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_bf16(float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const c10::BFloat16* p, int64_t i) { return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]); }
inline float ld(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(c10::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = float_to_bf16(v); }
inline void st(c10::Half* p, int64_t i, float v) { p[i] = static_cast<c10::Half>(v); }

// x rounded to the storage type S and back: the kernels round where the reference implementation (torch ops in the
// model dtype) rounds, so fused and unfused forwards agree to the last bit in most places, not only within tolerance.
template <typename S>
inline float rnd(float x);
template <>
inline float rnd<float>(float x) { return x; }
template <>
inline float rnd<c10::BFloat16>(float x) { return bf16_to_float(float_to_bf16(x)); }
template <>
inline float rnd<c10::Half>(float x) { return static_cast<float>(static_cast<c10::Half>(x)); }

template <typename C>
inline float dot(const float* a, const C* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * ld(b, i);
  return s;
}

// exp(x) = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2 (Cody-Waite split of ln 2) and e^r by its degree-6 Taylor
// polynomial: relative error < 2e-7 (about 1 ulp) on [-87, 88], inputs clamped there; branch-free, so loops vectorise.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// Rows of work below this many elements in total run on the calling thread: a parallel region costs more.
constexpr int64_t kSerialElems = 1 << 15;

// ---- add_rms_norm: x [T, N] float32 (updated in place when delta is given), delta [T, N], weight [N] float32 ----
Tensor add_rms_norm(Tensor x, const c10::optional<Tensor>& delta, const Tensor& weight, double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "add_rms_norm: x must be contiguous float32 [T, N]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "add_rms_norm: weight must be float32 [N]");
  const int64_t T = x.size(0), N = x.size(1);
  Tensor out = at::empty({T, N}, x.options().dtype(out_dtype));
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes(), "add_rms_norm: delta must be contiguous [T, N]");
  }
  const float feps = static_cast<float>(eps);
  auto run = [&](auto out_tag, auto delta_tag) {
    using O = decltype(out_tag);
    using DT = decltype(delta_tag);
    O* op = out.data_ptr<O>();
    const DT* dp = has_delta ? delta->data_ptr<DT>() : nullptr;
    const int64_t grain = T * N <= kSerialElems ? T : std::max<int64_t>(1, kSerialElems / N);
    at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* xr = xp + r * N;
        if (dp != nullptr) {
          const DT* d = dp + r * N;
#pragma omp simd
          for (int64_t i = 0; i < N; ++i) xr[i] += ld(d, i);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + feps);
        O* o = op + r * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) st(o, i, xr[i] * inv * wp[i]);
      }
    });
  };
  dispatch_float(out_dtype, "add_rms_norm out", [&](auto o) {
    if (has_delta) {
      dispatch_float(delta->scalar_type(), "add_rms_norm delta", [&](auto d) { run(o, d); });
    } else {
      run(o, float{});
    }
  });
  return out;
}

// ---- qk_rms_norm: Qwen3's per-head RMSNorm of q and k, qk [T, H + KVH, D] (rows may be strided: a view of the fused
// QKV output), q_weight / k_weight [D] in qk's dtype -> [T, H + KVH, D] contiguous in qk's dtype. As F.rms_norm computes
// it: float32 math, x * (1 / sqrt(mean(x^2) + eps)) * w, rounded once. Two F.rms_norm calls and a cat cost ~150 us a
// layer at batch 1 on two cores (each is a handful of ops on 32 x 128 values); this is a few microseconds.
Tensor qk_rms_norm(const Tensor& qk, const Tensor& q_weight, const Tensor& k_weight, double eps, int64_t num_heads) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk_rms_norm: qk must be [T, heads, D] with contiguous heads");
  const int64_t T = qk.size(0), NH = qk.size(1), D = qk.size(2);
  TORCH_CHECK(num_heads > 0 && num_heads < NH, "qk_rms_norm: num_heads must leave k heads");
  TORCH_CHECK(q_weight.numel() == D && k_weight.numel() == D && q_weight.scalar_type() == qk.scalar_type() &&
              k_weight.scalar_type() == qk.scalar_type(), "qk_rms_norm: weights must be [D] in qk's dtype");
  Tensor out = at::empty({T, NH, D}, qk.options());
  const Tensor qw = q_weight.contiguous(), kw = k_weight.contiguous();
  const float feps = static_cast<float>(eps);
  dispatch_float(qk.scalar_type(), "qk_rms_norm", [&](auto tag) {
    using S = decltype(tag);
    const S* in = qk.data_ptr<S>();
    S* op = out.data_ptr<S>();
    const S* wq = qw.data_ptr<S>();
    const S* wk = kw.data_ptr<S>();
    const int64_t rs = qk.stride(0);
    const int64_t grain = T * NH * D <= kSerialElems ? T : std::max<int64_t>(1, kSerialElems / (NH * D));
    at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t h = 0; h < NH; ++h) {
          const S* x = in + r * rs + h * D;
          const S* w = h < num_heads ? wq : wk;
          S* o = op + (r * NH + h) * D;
          float ss = 0.f;
#pragma omp simd reduction(+ : ss)
          for (int64_t i = 0; i < D; ++i) ss += ld(x, i) * ld(x, i);
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + feps);
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) st(o, i, ld(x, i) * inv * ld(w, i));
        }
      }
    });
  });
  return out;
}

// silu(g) * u over one row of n: silu rounded to S before the product, as torch rounds it. Every element of a row goes
// through the same code (the tail by masked lanes), so a row's result does not depend on n or on the rows beside it.
// Written with intrinsics where AVX-512 is there (exp16 is exp_approx op for op: the same bits as the loop below): gcc
// left the portable loop scalar inside the parallel lambda (measured, a call on 8 x 1536 bf16 elements: 23.2 us, 10.5
// us vectorised, most of it the call itself).
template <typename S>
inline void silu_mul_row(const S* g, const S* u, S* o, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  using namespace tandem_kernels;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 gv = load16(g + i, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 silu = round16<S>(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(o + i, _mm512_mul_ps(silu, load16(u + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float gv = ld(g, i);
    st(o, i, rnd<S>(gv / (1.f + exp_approx(-gv))) * ld(u, i));
  }
#endif
}

// ---- silu_mul: gu [T, 2I] -> silu(gu[:, :I]) * gu[:, I:] [T, I], same dtype, math in float32 ----
Tensor silu_mul(const Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: gu must be contiguous [T, 2I]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  Tensor out = at::empty({T, I}, gu.options());
  dispatch_float(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using S = decltype(tag);
    const S* in = gu.data_ptr<S>();
    S* op = out.data_ptr<S>();
    const int64_t grain = T * I <= kSerialElems ? T : std::max<int64_t>(1, kSerialElems / I);
    at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const S* g = in + r * 2 * I;
        silu_mul_row(g, g + I, op + r * I, I);
      }
    });
  });
  return out;
}

// ---- rope_write_kv ----
// qk [T, H + KVH, D] (heads contiguous, any row stride), v [T, KVH, D] (same), positions [T] int64,
// cos / sin [max_pos, D / 2] float32, kv_cache [2, KVH, NB, BS, D] (float32, bfloat16 or float16), slots [T] int64.
// Returns rotated q and k as float32 [T, H + KVH, D]; writes rotated k and v at each token's slot, each K block
// transposed to [D, BS] (see paged_attention).
// Rotate-half RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves of each head.
Tensor rope_write_kv(const Tensor& qk, const Tensor& v, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                     Tensor kv_cache, const Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "rope_write_kv: qk must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2), "rope_write_kv: v must be [T, KVH, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4), "rope_write_kv: kv_cache must be [2, KVH, NB, BS, D] with contiguous blocks");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "rope_write_kv: cos / sin must be contiguous float32");
  TORCH_CHECK(qk.scalar_type() == v.scalar_type(), "rope_write_kv: qk and v must share a dtype");
  const int64_t T = qk.size(0), NH = qk.size(1), D = qk.size(2), KVH = v.size(1), half = D / 2;
  TORCH_CHECK(NH == num_heads + KVH && kv_cache.size(1) == KVH && kv_cache.size(4) == D && D % 2 == 0, "rope_write_kv: head counts do not match the cache");
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3), BS = kv_cache.size(3);
  const int64_t S0 = kv_cache.stride(0), SH = kv_cache.stride(1), SB = kv_cache.stride(2);  // K -> V, head, block
  Tensor out = at::empty({T, NH, D}, qk.options().dtype(at::kFloat));
  Tensor pos = positions.to(at::kLong).contiguous();
  Tensor sl = slots.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos && sp[t] >= 0 && sp[t] < slots_per_head, "rope_write_kv: position or slot out of range");
  }
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_float(qk.scalar_type(), "rope_write_kv", [&](auto tag) {
    using S = decltype(tag);
    dispatch_float(kv_cache.scalar_type(), "rope_write_kv cache", [&](auto ctag) {
      using C = decltype(ctag);
      const S* qkp = qk.data_ptr<S>();
      const S* vp = v.data_ptr<S>();
      C* cache = kv_cache.data_ptr<C>();
      const int64_t qs = qk.stride(0), vs = v.stride(0);
      const int64_t grain = T * NH * D <= kSerialElems ? T : std::max<int64_t>(1, kSerialElems / (NH * D));
      at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t slot = sp[t];
          const float* c = cp + pp[t] * half;
          const float* s = snp + pp[t] * half;
          for (int64_t h = 0; h < NH; ++h) {
            const S* x = qkp + t * qs + h * D;
            float* o = op + (t * NH + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
              // rounded as the reference computes it in the model dtype: round(round(x cos) + round(rot(x) sin))
              const float x1 = ld(x, i), x2 = ld(x, i + half);
              o[i] = rnd<S>(rnd<S>(x1 * c[i]) + rnd<S>(-x2 * s[i]));
              o[i + half] = rnd<S>(rnd<S>(x2 * c[i]) + rnd<S>(x1 * s[i]));
            }
            if (h >= num_heads) {
              const int64_t kvh = h - num_heads;
              // K block [D, BS] (key index fastest), V block [BS, D]
              C* kc = cache + kvh * SH + (slot / BS) * SB + slot % BS;
              C* vc = cache + S0 + kvh * SH + (slot / BS) * SB + (slot % BS) * D;
              const S* vx = vp + t * vs + kvh * D;
              for (int64_t i = 0; i < D; ++i) st(kc, i * BS, o[i]);
#pragma omp simd
              for (int64_t i = 0; i < D; ++i) st(vc, i, ld(vx, i));
            }
          }
        }
      });
    });
  });
  return out;
}

// ---- paged_attention ----
// q float32 [T, H, D] (heads contiguous, any row stride); kv_cache [2, KVH, NB, BS, D] (float32, bfloat16 or float16);
// seq_info int64 [B, 3] = (first row in T, number of queries n, tokens cached before them `start`);
// block_tables int64 [B, max_blocks]; out [T, H * D] (any float dtype), rows of the listed requests written.
// Query j of a request sits at position start + j and attends keys [0, start + j] (causal), or with a sliding
// `window` > 0 the last `window` of them, [start + j - window + 1, start + j] (Mistral, Qwen2, gpt-oss); `sinks` float32
// [H] or None: query head h's softmax has one more logit, sinks[h], with no value (gpt-oss). Heads are grouped (GQA):
// query head h reads kv head h / G. One work item is (request, kv head): its n * G query rows read each key once.
// The math is float32 whatever the cache holds.
// dst[r, 0:BS] = scale * sum_d q[r][d] * K[d, 0:BS] for RBc query rows against one K block stored [D, BS]; dst rows
// are `stride` apart.
template <int RBc, int64_t BSC, int64_t DC, typename C>
inline void score_tile(const float* const* q, const C* kt, int64_t BSrt, int64_t Drt, float scale, float* dst, int64_t stride) {
  const int64_t BS = BSC > 0 ? BSC : BSrt;
  const int64_t D = DC > 0 ? DC : Drt;
  float tile[RBc][BSC > 0 ? BSC : 256];
  for (int r = 0; r < RBc; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < BS; ++i) tile[r][i] = 0.f;
  }
  for (int64_t d = 0; d < D; ++d) {
    const C* kd = kt + d * BS;
#pragma omp simd
    for (int64_t i = 0; i < BS; ++i) {
      const float k = ld(kd, i);
      for (int r = 0; r < RBc; ++r) tile[r][i] += q[r][d] * k;
    }
  }
  for (int r = 0; r < RBc; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < BS; ++i) dst[r * stride + i] = tile[r][i] * scale;
  }
}

// o[r] = sc[r] * sum_{b0 BS <= t < keys} w[r][t] * V_t for RBc rows; V blocks [BS, D] of kv head `kvh` through `table`.
template <int RBc, int64_t DC, typename C, typename O>
inline void value_tile(const float* const* w, const float* sc, const C* vc, int64_t SB, const int64_t* table,
                       int64_t BS, int64_t Drt, int64_t b0, int64_t keys, O* const* o) {
  const int64_t D = DC > 0 ? DC : Drt;
  float acc[RBc][DC > 0 ? DC : 512];
  for (int r = 0; r < RBc; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[r][i] = 0.f;
  }
  for (int64_t b = b0; b * BS < keys; ++b) {
    const C* vb = vc + table[b] * SB;  // [BS, D]
    const int64_t te = std::min(BS, keys - b * BS);
    for (int64_t t = 0; t < te; ++t) {
      const C* v = vb + t * D;
      float wt[RBc];
      for (int r = 0; r < RBc; ++r) wt[r] = w[r][b * BS + t];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        const float vi = ld(v, i);
        for (int r = 0; r < RBc; ++r) acc[r][i] += wt[r] * vi;
      }
    }
  }
  for (int r = 0; r < RBc; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) st(o[r], i, acc[r][i] * sc[r]);
  }
}

// One (request, kv head) work item. DC is the head dim when known at compile time (64, 128), else 0 (runtime D): with
// it fixed, an output accumulator stays in vector registers across all keys.
// Cache blocks: K as [D, BS] (key index fastest), V as [BS, D]. Scores are then, per block and per 4 query rows,
// s[r, 0:BS] += q[r, d] * K[d, 0:BS] over d: vector FMAs across keys, no horizontal sums.
template <int64_t DC, int64_t BSC, typename C, typename O>
void attend_item(const float* qp, int64_t qs, const C* kc, const C* vc, const int64_t* table, int64_t row0, int64_t n,
                 int64_t start, int64_t kvh, int64_t G, int64_t H, int64_t SB, int64_t BSrt, int64_t Drt, float scale,
                 int64_t window, const float* sinks, O* op, std::vector<float>& p, std::vector<float>& kbuf) {
  constexpr int64_t RB = 4;  // query rows per score tile
  const int64_t D = DC > 0 ? DC : Drt;
  const int64_t BS = BSC > 0 ? BSC : BSrt;
  const int64_t L = start + n, R = n * G;
  const int64_t nblocks = (L + BS - 1) / BS, Lp = nblocks * BS;
  // the first key row r sees: 0, or with a window the oldest key inside it; blocks before the first row's are skipped
  auto first_key = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, start + r / G - window + 1) : int64_t{0}; };
  const int64_t b0 = first_key(0) / BS;
  p.resize(R * Lp);
  auto qrow = [&](int64_t r) { return qp + (row0 + r / G) * qs + (kvh * G + r % G) * D; };
  const int64_t block_bytes = BS * D * static_cast<int64_t>(sizeof(C));
  for (int64_t b = b0; b < nblocks; ++b) {
    const C* kt = kc + table[b] * SB;  // [D, BS]
    if (b + 1 < nblocks) {  // blocks are scattered: the hardware prefetcher cannot guess the next one
      const char* nk = reinterpret_cast<const char*>(kc + table[b + 1] * SB);
      const char* nv = reinterpret_cast<const char*>(vc + table[b + 1] * SB);
      for (int64_t off = 0; off < block_bytes; off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int64_t rr = std::min(RB, R - r0);
      const float* q[RB];
      for (int64_t r = 0; r < rr; ++r) q[r] = qrow(r0 + r);
      float* dst = p.data() + r0 * Lp + b * BS;
      switch (rr) {  // the row count fixed at compile time keeps the tile in registers and wastes no FMAs
        case 4: score_tile<4, BSC, DC>(q, kt, BS, D, scale, dst, Lp); break;
        case 3: score_tile<3, BSC, DC>(q, kt, BS, D, scale, dst, Lp); break;
        case 2: score_tile<2, BSC, DC>(q, kt, BS, D, scale, dst, Lp); break;
        default: score_tile<1, BSC, DC>(q, kt, BS, D, scale, dst, Lp); break;
      }
    }
  }
  // softmax over each row's visible keys [lo, start + j]; weights outside them (from block b0 on) set to 0,
  // normalised at the end
  float inv[64];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = start + r / G + 1, lo = first_key(r);
    float* pr = p.data() + r * Lp;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = lo; t < len; ++t) m = std::max(m, pr[t]);
    const float sink = sinks != nullptr ? sinks[kvh * G + r % G] : 0.f;  // query head kvh * G + r % G's
    if (sinks != nullptr) m = std::max(m, sink);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = lo; t < len; ++t) {
      pr[t] = exp_approx(pr[t] - m);
      sum += pr[t];
    }
    if (sinks != nullptr) sum += exp_approx(sink - m);  // one more logit in the denominator, with no value
    std::fill(pr + b0 * BS, pr + lo, 0.f);
    std::fill(pr + len, pr + Lp, 0.f);
    inv[r % 64] = 1.f / sum;
    if (r % 64 == 63 || r == R - 1) {
      // out rows: sum_t p[r, t] v_t, up to 4 rows per pass over V (each V row widened once per pass)
      const int64_t first = r - r % 64;
      for (int64_t r0 = first; r0 <= r; r0 += RB) {
        const int64_t rr = std::min<int64_t>(RB, r + 1 - r0);
        const int64_t keys = start + (r0 + rr - 1) / G + 1;  // the tile's last row sees the most keys
        O* o[RB];
        const float* w[RB];
        float sc[RB];
        for (int64_t i = 0; i < rr; ++i) {
          const int64_t row = r0 + i;
          o[i] = op + (row0 + row / G) * H * D + (kvh * G + row % G) * D;
          w[i] = p.data() + row * Lp;
          sc[i] = inv[row % 64];
        }
        switch (rr) {
          case 4: value_tile<4, DC>(w, sc, vc, SB, table, BS, D, b0, keys, o); break;
          case 3: value_tile<3, DC>(w, sc, vc, SB, table, BS, D, b0, keys, o); break;
          case 2: value_tile<2, DC>(w, sc, vc, SB, table, BS, D, b0, keys, o); break;
          default: value_tile<1, DC>(w, sc, vc, SB, table, BS, D, b0, keys, o); break;
        }
      }
    }
  }
}

template <typename C, typename O>
void attend(const float* qp, int64_t qs, const C* kc, const C* vc, const int64_t* info, const int64_t* tables,
            int64_t B, int64_t MB, int64_t H, int64_t KVH, int64_t SH, int64_t SB, int64_t BS, int64_t D, float scale,
            int64_t window, const float* sinks, O* op, int64_t grain) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> p, kbuf;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / KVH, kvh = w % KVH;
      const int64_t row0 = info[b * 3], n = info[b * 3 + 1], start = info[b * 3 + 2];
      const int64_t* table = tables + b * MB;
      auto item = [&](auto dc, auto bsc) {
        attend_item<decltype(dc)::value, decltype(bsc)::value>(qp, qs, kc + kvh * SH, vc + kvh * SH, table, row0, n, start,
                                                               kvh, G, H, SB, BS, D, scale, window, sinks, op, p, kbuf);
      };
      using D64 = std::integral_constant<int64_t, 64>;
      using D128 = std::integral_constant<int64_t, 128>;
      using Any = std::integral_constant<int64_t, 0>;
      using B16 = std::integral_constant<int64_t, 16>;
      if (BS == 16 && D == 64) {
        item(D64{}, B16{});
      } else if (BS == 16 && D == 128) {
        item(D128{}, B16{});
      } else {
        item(Any{}, Any{});
      }
    }
  });
}

void paged_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& seq_info, const Tensor& block_tables, double scale,
                     Tensor out, int64_t window, const c10::optional<Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q must be float32 [T, H, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4), "paged_attention: kv_cache must be [2, KVH, NB, BS, D] with contiguous blocks");
  TORCH_CHECK(seq_info.scalar_type() == at::kLong && seq_info.is_contiguous() && seq_info.dim() == 2 && seq_info.size(1) == 3, "paged_attention: seq_info must be int64 [B, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2, "paged_attention: block_tables must be int64 [B, max_blocks]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == q.size(0) && out.numel() == q.size(0) * q.size(1) * q.size(2), "paged_attention: out must be contiguous [T, H * D]");
  const int64_t H = q.size(1), D = q.size(2), KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0 && kv_cache.size(4) == D, "paged_attention: head counts do not match the cache");
  TORCH_CHECK(D <= 512 && BS <= 256, "paged_attention: head_dim <= 512 and block_size <= 256 are supported, got ", D,
              " and ", BS);
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: no sliding window), got ", window);
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == H),
              "paged_attention: sinks must be contiguous float32 [H]");
  const float* sink_ptr = has_sinks ? sinks->data_ptr<float>() : nullptr;
  const int64_t B = seq_info.size(0), MB = block_tables.size(1);
  const int64_t* info = seq_info.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row0 = info[b * 3], n = info[b * 3 + 1], start = info[b * 3 + 2];
    TORCH_CHECK(n >= 1 && start >= 0 && row0 >= 0 && row0 + n <= q.size(0), "paged_attention: request ", b, " has rows outside q");
    TORCH_CHECK((start + n + BS - 1) / BS <= MB, "paged_attention: request ", b, " needs more blocks than its table holds");
    for (int64_t i = 0; i < (start + n + BS - 1) / BS; ++i) {
      TORCH_CHECK(tables[b * MB + i] >= 0 && tables[b * MB + i] < NB, "paged_attention: block id out of range");
    }
    work += n * (start + n) * H * D;
  }
  const int64_t grain = work <= kSerialElems * 4 ? std::max<int64_t>(1, B * KVH) : 1;
  dispatch_float(kv_cache.scalar_type(), "paged_attention cache", [&](auto ctag) {
    using C = decltype(ctag);
    dispatch_float(out.scalar_type(), "paged_attention out", [&](auto otag) {
      using O = decltype(otag);
      const C* kc = kv_cache.data_ptr<C>();
      attend<C, O>(q.data_ptr<float>(), q.stride(0), kc, kc + kv_cache.stride(0), info, tables, B, MB, H, KVH,
                   kv_cache.stride(1), kv_cache.stride(2), BS, D, static_cast<float>(scale), window, sink_ptr,
                   out.data_ptr<O>(), grain);
    });
  });
}


// ---- linear_bf16: y [M, N] = x [M, K] @ W^T (+ bias), bf16 in and out, float32 accumulation ----
// W is packed [N / 16, K / 2, 16, 2]: for each block of 16 output columns, K in pairs, so one AVX512-BF16
// `vdpbf16ps` multiplies a broadcast pair of x by the same pair of 16 columns. A micro-tile of MR rows x 64 columns
// keeps 16 accumulators in registers; the 4 column streams are re-read from L2 for every tile of rows. Each output
// row is computed the same way whatever M is, so a request's numbers do not depend on its batch.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHasBf16Gemm = true;

template <int MR, int NB>
inline void gemm_tile(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t cb0, const uint16_t* bias, uint16_t* y,
                      int64_t N) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;
  const uint16_t* wcol[NB];
  for (int j = 0; j < NB; ++j) wcol[j] = wp + (cb0 + j) * K2 * 32;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_si512(wcol[j] + k2 * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * k2, 4);
      const __m512i a = _mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + (cb0 + j) * 16));
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int r = 0; r < MR; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], bv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (cb0 + j) * 16), (__m256i)out);
    }
  }
}

template <int NB>
inline void gemm_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t cb0, const uint16_t* bias,
                      uint16_t* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) gemm_tile<4, NB>(x + m * K, K, wp, cb0, bias, y + m * N, N);
  switch (M - m) {
    case 3: gemm_tile<3, NB>(x + m * K, K, wp, cb0, bias, y + m * N, N); break;
    case 2: gemm_tile<2, NB>(x + m * K, K, wp, cb0, bias, y + m * N, N); break;
    case 1: gemm_tile<1, NB>(x + m * K, K, wp, cb0, bias, y + m * N, N); break;
    default: break;
  }
}
constexpr int64_t kBf16GemmIsa = 2;
#elif defined(__AVX2__) && defined(__FMA__)
// No bf16 dot product: each packed 32-bit lane (k even in its low half, k odd in its high half) widens to two float32
// values with a shift and a mask, multiplied by float32 copies of x in FMAs. torch's bf16 F.linear on such a CPU (AMD
// EPYC Zen 3, 2 threads) ran 2.7x / 4.7x slower than float32 at 8 / 32 rows; this reads half of float32's bytes at one
// row. Every output accumulates, from zero, x[2i] * w[2i] then x[2i + 1] * w[2i + 1] for i ascending (two rounded
// FMAs, not vdpbf16ps's sum), then adds the bias and rounds once to bf16 (nearest even): the same at any M.
constexpr bool kHasBf16Gemm = true;
constexpr int64_t kBf16GemmIsa = 1;

// float32 -> bf16, round to nearest even; NaN stays a quiet NaN (as _mm512_cvtneps_pbh)
inline __m256i bf16_round(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// MR rows x NB blocks of 16 columns; x is float32 [MR, K] (row stride K). MR * NB <= 4: 2 * MR * NB accumulators, the
// block's four widened weight vectors and two broadcasts stay in AVX2's 16 registers.
template <int MR, int NB>
inline void gemm_tile(const float* x, int64_t K, const uint16_t* wp, int64_t cb0, const uint16_t* bias, uint16_t* y,
                      int64_t N) {
  static_assert(MR * NB <= 4, "AVX2 has 16 vector registers");
  __m256 acc[MR][NB][2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const int64_t K2 = K / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* wcol[NB];
  for (int j = 0; j < NB; ++j) wcol[j] = wp + (cb0 + j) * K2 * 32;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    for (int j = 0; j < NB; ++j) {
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wcol[j] + k2 * 32));       // columns 0-7
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wcol[j] + k2 * 32 + 16));  // 8-15
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16)), odd0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16)), odd1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));
      for (int r = 0; r < MR; ++r) {
        const __m256 a0 = _mm256_broadcast_ss(x + r * K + 2 * k2), a1 = _mm256_broadcast_ss(x + r * K + 2 * k2 + 1);
        acc[r][j][0] = _mm256_fmadd_ps(a1, odd0, _mm256_fmadd_ps(a0, even0, acc[r][j][0]));
        acc[r][j][1] = _mm256_fmadd_ps(a1, odd1, _mm256_fmadd_ps(a0, even1, acc[r][j][1]));
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias != nullptr) {
      const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + (cb0 + j) * 16));
      b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bb)), 16));
      b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bb, 1)), 16));
    }
    for (int r = 0; r < MR; ++r) {
      // packus works within 128-bit halves: [0-3, 8-11, 4-7, 12-15] -> columns in order
      const __m256i packed = _mm256_packus_epi32(bf16_round(_mm256_add_ps(acc[r][j][0], b0)),
                                                 bf16_round(_mm256_add_ps(acc[r][j][1], b1)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (cb0 + j) * 16), _mm256_permute4x64_epi64(packed, 0xD8));
    }
  }
}

// the rows of x over nb (1-4) blocks from cb0: one row spans all nb blocks (nb weight streams at once, latency hidden
// across 2 * nb accumulators); more rows go block by block in tiles of up to four rows (the block re-read from L2)
inline void gemm_rows_avx2(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t cb0, int64_t nb,
                           const uint16_t* bias, uint16_t* y, int64_t N) {
  if (M == 1) {
    switch (nb) {
      case 4: gemm_tile<1, 4>(x, K, wp, cb0, bias, y, N); return;
      case 3: gemm_tile<1, 3>(x, K, wp, cb0, bias, y, N); return;
      case 2: gemm_tile<1, 2>(x, K, wp, cb0, bias, y, N); return;
      default: gemm_tile<1, 1>(x, K, wp, cb0, bias, y, N); return;
    }
  }
  int64_t j = 0;
  for (; M == 2 && j + 2 <= nb; j += 2) gemm_tile<2, 2>(x, K, wp, cb0 + j, bias, y, N);
  for (; j < nb; ++j) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemm_tile<4, 1>(x + m * K, K, wp, cb0 + j, bias, y + m * N, N);
    switch (M - m) {
      case 3: gemm_tile<3, 1>(x + m * K, K, wp, cb0 + j, bias, y + m * N, N); break;
      case 2: gemm_tile<2, 1>(x + m * K, K, wp, cb0 + j, bias, y + m * N, N); break;
      case 1: gemm_tile<1, 1>(x + m * K, K, wp, cb0 + j, bias, y + m * N, N); break;
      default: break;
    }
  }
}
#else
constexpr bool kHasBf16Gemm = false;
constexpr int64_t kBf16GemmIsa = 0;
#endif

bool has_bf16_gemm() { return kHasBf16Gemm; }
// which linear_bf16 this build runs: 2 AVX512-BF16 (and AMX where permitted), 1 AVX2 / FMA (widened to float32), 0 none
int64_t bf16_gemm_isa() { return kBf16GemmIsa; }

// ---- the same GEMM on AMX tiles (Sapphire Rapids and later), over the same packed weight ----
// A B tile is 16 k-pairs x 16 columns x 2 = the packed weight's [K / 2, 16, 2] block read 16 k-pairs at a time (1 KiB,
// contiguous), so AMX and AVX512-BF16 share one copy of W. Tiles: C 0-3 (2 x 2 blocks of 16 x 16 float32), A 4-5 (16
// rows x 32 bf16 of x), B 6-7. Every output accumulates its k-pairs in ascending order from zero, then adds the bias
// and rounds once, as gemm_tile does; whether the tile unit rounds the same way as vdpbf16ps is a property of the
// CPU, checked at calibration (tandem/layers/gemm_plan.py) before the two are mixed by row count.
// Needs K % 32 == 0 (whole A tiles); callers fall back to linear_bf16's AVX512 path otherwise.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool kHasAmxBf16 = true;

inline bool amx_permitted() { return tandem_amx::permitted(); }

// C tiles and A tiles of the two 16-row halves get rows0 / rows1 rows (0: that half is not used); A: 32 bf16 of k
inline void amx_configure(int rows0, int rows1) { tandem_amx::configure(rows0, rows1, 64, 16); }

// B tiles prefetched this many k-tiles ahead: the weight streams from memory once per call at few rows, and tile
// loads alone left the 49,152 x 576 output projection at 17 GFLOP/s at 1 row, 340 at 32 (22-24 and 470-510 with it)
constexpr int64_t kAmxPrefetch = 2;

// c [32, 32] float32 (+)= x[rows, k-tiles t0..t1) @ W[cb0 * 16 .. (cb0 + NBT) * 16)^T for MA halves of 16 rows;
// `resume`: c holds the sums of the k-tiles before t0 (reloaded exactly, so the order of additions is unchanged)
template <int MA, int NBT>
inline void amx_block(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t cb0, int64_t t0, int64_t t1, bool resume,
                      float* c) {
  const int64_t K2 = K / 2, xs = K * 2;
  if (resume) {
    _tile_loadd(0, c, 128);
    if constexpr (NBT > 1) _tile_loadd(1, c + 16, 128);
    if constexpr (MA > 1) {
      _tile_loadd(2, c + 16 * 32, 128);
      if constexpr (NBT > 1) _tile_loadd(3, c + 16 * 32 + 16, 128);
    }
  } else {
    _tile_zero(0);
    if constexpr (NBT > 1) _tile_zero(1);
    if constexpr (MA > 1) {
      _tile_zero(2);
      if constexpr (NBT > 1) _tile_zero(3);
    }
  }
  const uint16_t* w0 = wp + cb0 * K2 * 32;
  const uint16_t* w1 = w0 + K2 * 32;
  for (int64_t t = t0; t < t1; ++t) {
    if constexpr (kAmxPrefetch > 0) {
      if (t + kAmxPrefetch < t1) {
        for (int l = 0; l < 16; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(w0 + (t + kAmxPrefetch) * 512 + l * 32), _MM_HINT_T0);
          if constexpr (NBT > 1) _mm_prefetch(reinterpret_cast<const char*>(w1 + (t + kAmxPrefetch) * 512 + l * 32), _MM_HINT_T0);
        }
      }
    }
    _tile_loadd(4, x + t * 32, xs);
    _tile_loadd(6, w0 + t * 512, 64);
    if constexpr (NBT > 1) _tile_loadd(7, w1 + t * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NBT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MA > 1) {
      _tile_loadd(5, x + 16 * K + t * 32, xs);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NBT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NBT > 1) _tile_stored(1, c + 16, 128);
  if constexpr (MA > 1) {
    _tile_stored(2, c + 16 * 32, 128);
    if constexpr (NBT > 1) _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

inline void amx_write(const float* c, int rows, int nbt, const uint16_t* bias, int64_t cb0, uint16_t* y, int64_t N) {
  for (int j = 0; j < nbt; ++j) {
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + (cb0 + j) * 16));
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int r = 0; r < rows; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 32 + j * 16), bv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + (cb0 + j) * 16), (__m256i)out);
    }
  }
}

// Column blocks [cb_begin, cb_end) of all M rows. Blocking, so that the operand each tile multiply reloads sits in L1
// and the other in L2: columns in chunks whose weight (~256 KiB) stays in L2 while every 32-row block of x passes over
// it; K in spans of kAmxKTiles tiles, so the 32 rows x span of x (16 KiB) stay in L1 while the chunk's column pairs
// take turns, each pair's partial sums parked in `parked` between spans (more than 32 rows only).
constexpr int64_t kAmxKTiles = 8;

void amx_columns(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t cb_begin, int64_t cb_end,
                 const uint16_t* bias, uint16_t* y, int64_t N) {
  const int64_t chunk = std::max<int64_t>(2, (int64_t{256} * 1024 / (K * 32)) & ~int64_t{1});  // column blocks
  const int64_t KT = K / 32;
  std::vector<float> parked_buf(static_cast<size_t>((chunk / 2) * 32 * 32 + 16));
  float* parked = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(parked_buf.data()) + 63) & ~uintptr_t{63});
  int configured = -1;
  for (int64_t n0 = cb_begin; n0 < cb_end; n0 += chunk) {
    const int64_t n1 = std::min(cb_end, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m0));
      const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m0 - 16, 0, 16));
      if (configured != rows0 * 17 + rows1) {
        amx_configure(rows0, rows1);
        configured = rows0 * 17 + rows1;
      }
      const uint16_t* xm = x + m0 * K;
      const int64_t span = M > 32 ? kAmxKTiles : KT;  // one block of rows: nothing to keep in L1, stream W in order
      for (int64_t t0 = 0; t0 < KT; t0 += span) {
        const int64_t t1 = std::min(KT, t0 + span);
        for (int64_t cb = n0; cb < n1; cb += 2) {
          const int nbt = static_cast<int>(std::min<int64_t>(2, n1 - cb));
          float* c = parked + ((cb - n0) / 2) * 32 * 32;
          const bool resume = t0 > 0;
          if (rows1 > 0) {
            nbt == 2 ? amx_block<2, 2>(xm, K, wp, cb, t0, t1, resume, c) : amx_block<2, 1>(xm, K, wp, cb, t0, t1, resume, c);
          } else {
            nbt == 2 ? amx_block<1, 2>(xm, K, wp, cb, t0, t1, resume, c) : amx_block<1, 1>(xm, K, wp, cb, t0, t1, resume, c);
          }
          if (t1 == KT) {
            amx_write(c, rows0, nbt, bias, cb, y + m0 * N, N);
            if (rows1 > 0) amx_write(c + 16 * 32, rows1, nbt, bias, cb, y + (m0 + 16) * N, N);
          }
        }
      }
    }
  }
  _tile_release();
}
#else
constexpr bool kHasAmxBf16 = false;
inline bool amx_permitted() { return false; }
#endif

bool has_amx_bf16() { return kHasAmxBf16 && amx_permitted(); }

// amx_rows > 0: calls of at least that many rows run on AMX tiles (when the CPU and K allow), the rest on AVX512-BF16
Tensor linear_bf16(const Tensor& x, const Tensor& wp, const c10::optional<Tensor>& bias, int64_t amx_rows) {
  TORCH_CHECK(kHasBf16Gemm, "linear_bf16: this build has neither AVX512-BF16 nor AVX2 / FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear_bf16: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.size(2) == 16 && wp.size(3) == 2,
              "linear_bf16: weight must be packed [N / 16, K / 2, 16, 2] bf16");
  const int64_t M = x.size(0), K = x.size(1), NBLK = wp.size(0), N = NBLK * 16;
  TORCH_CHECK(wp.size(1) * 2 == K, "linear_bf16: K mismatch");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "linear_bf16: bias must be bf16 [N]");
  }
  Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  const uint16_t* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_rows > 0 && M >= amx_rows && K % 32 == 0 && M > 0 && amx_permitted()) {
    const int64_t pairs = (NBLK + 1) / 2;  // work unit: 32 output columns (one pair of B tiles)
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      amx_columns(xp, M, K, w, p0 * 2, std::min(NBLK, p1 * 2), bp, yp, N);
    });
    return y;
  }
#endif
  const int64_t groups = (NBLK + 3) / 4;  // work unit: 64 output columns (4 blocks of 16)
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cb0 = g * 4, nb = std::min<int64_t>(4, NBLK - cb0);
      switch (nb) {
        case 4: gemm_rows<4>(xp, M, K, w, cb0, bp, yp, N); break;
        case 3: gemm_rows<3>(xp, M, K, w, cb0, bp, yp, N); break;
        case 2: gemm_rows<2>(xp, M, K, w, cb0, bp, yp, N); break;
        default: gemm_rows<1>(xp, M, K, w, cb0, bp, yp, N); break;
      }
    }
  });
#elif defined(__AVX2__) && defined(__FMA__)
  (void)amx_rows;
  const Tensor xf = x.to(at::kFloat);  // [M, K]: exact, widened once for every column
  const float* xp = xf.data_ptr<float>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  const uint16_t* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t groups = (NBLK + 3) / 4;  // work unit: 64 output columns (4 blocks of 16)
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) gemm_rows_avx2(xp, M, K, w, g * 4, std::min<int64_t>(4, NBLK - g * 4), bp, yp, N);
  });
#endif
  return y;
}

// ---- greedy_tokens: the argmax of each logits row among the tokens its grammar bitmask allows ----
// Greedy sampling under a grammar at an accelerator's batch over a large vocabulary (256 rows x 200k tokens) through
// torch ops is a float32 copy, an unpacked [R, V] mask, a masked fill, an all-(-inf) check and an argmax: 0.5-0.7 s a
// step on 2 cores. One pass here reads each 32-token word of the mask once, skips the words that allow nothing and
// compares only the allowed logits (AVX512: a word's bits are the lanes' mask). Ties go to the lowest token id, as
// torch.argmax's do; NaN logits are never chosen; a row where no allowed token has a logit above -inf gets -1.
template <typename T>
inline void scan_word(const T* x, int64_t base, uint32_t bits, float& best, int64_t& best_i) {
  while (bits != 0u) {
    const int j = __builtin_ctz(bits);
    bits &= bits - 1u;
    const float v = ld(x, base + j);
    if (v > best) {
      best = v;
      best_i = base + j;
    }
  }
}

#if defined(__AVX512F__)
using tandem_kernels::load16;

// words [0, nw) of a row, every one fully inside the vocabulary: per-lane maxima (strictly greater: a lane keeps its
// first maximum), then the lowest index among the lanes holding the row's maximum
template <typename T>
inline void greedy_words_avx512(const T* x, const uint32_t* mask, int64_t nw, float& best, int64_t& best_i) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i vidx = _mm512_set1_epi32(-1);
  for (int64_t w = 0; w < nw; ++w) {
    const uint32_t bits = mask != nullptr ? mask[w] : 0xFFFFFFFFu;
    if (bits == 0u) continue;
    for (int half = 0; half < 2; ++half) {
      const __mmask16 m = static_cast<__mmask16>(bits >> (16 * half));
      if (m == 0) continue;
      const int64_t base = w * 32 + 16 * half;
      const __m512 v = load16(x + base);
      const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(base))));
    }
  }
  const float top = _mm512_reduce_max_ps(vmax);
  if (!(top > best)) return;
  const __mmask16 at_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const __m512i idx = _mm512_mask_mov_epi32(_mm512_set1_epi32(std::numeric_limits<int32_t>::max()), at_top, vidx);
  best = top;
  best_i = _mm512_reduce_min_epi32(idx);
}
#endif

template <typename T>
int64_t greedy_row(const T* x, const uint32_t* mask, int64_t W, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = -1;
  const int64_t words = mask != nullptr ? std::min<int64_t>(W, (V + 31) / 32) : (V + 31) / 32;
  int64_t w = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, c10::Half>) {
    const int64_t full = std::min<int64_t>(words, V / 32);  // words whose 32 tokens are all in the vocabulary
    greedy_words_avx512(x, mask, full, best, best_i);
    w = full;
  }
#endif
  for (; w < words; ++w) {
    uint32_t bits = mask != nullptr ? mask[w] : 0xFFFFFFFFu;
    const int64_t n = std::min<int64_t>(32, V - w * 32);
    if (n < 32) bits &= (1u << n) - 1u;
    scan_word(x, w * 32, bits, best, best_i);
  }
  return best_i;
}

// `rows` (int64 [R]): the logits rows to read, in order, in place of all of them (a step's verify rows read where they
// are: copying ~770 rows of a 49k vocabulary took 2-4 ms a step before this pass on 2 cores); the bitmask's rows
// follow the output's.
Tensor greedy_tokens(const Tensor& logits, const c10::optional<Tensor>& bitmask, int64_t vocab_size,
                     const c10::optional<Tensor>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "greedy_tokens: logits must be [R, V] with contiguous rows");
  const bool picked = rows.has_value() && rows->defined();
  if (picked) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->is_contiguous(),
                "greedy_tokens: rows must be contiguous int64 [R]");
    const int64_t* ri = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < rows->numel(); ++i)
      TORCH_CHECK(ri[i] >= 0 && ri[i] < logits.size(0), "greedy_tokens: a row outside the logits");
  }
  const int64_t R = picked ? rows->numel() : logits.size(0);
  const int64_t* row_of = picked ? rows->data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(vocab_size >= 0 && vocab_size <= logits.size(1), "greedy_tokens: vocab_size outside the logits' columns");
  const bool has_mask = bitmask.has_value() && bitmask->defined();
  int64_t W = 0;
  if (has_mask) {
    TORCH_CHECK(bitmask->dim() == 2 && bitmask->scalar_type() == at::kInt && bitmask->is_contiguous() &&
                bitmask->size(0) == R, "greedy_tokens: bitmask must be contiguous int32 [R, W]");
    W = bitmask->size(1);
  }
  Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const uint32_t* m = has_mask ? reinterpret_cast<const uint32_t*>(bitmask->data_ptr<int32_t>()) : nullptr;
  const int64_t stride = logits.stride(0);
  dispatch_float(logits.scalar_type(), "greedy_tokens", [&](auto tag) {
    using T = decltype(tag);
    const T* x = logits.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = row_of != nullptr ? row_of[r] : r;
        o[r] = greedy_row(x + src * stride, m != nullptr ? m + r * W : nullptr, W, vocab_size);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("qk_rms_norm(Tensor qk, Tensor q_weight, Tensor k_weight, float eps, int num_heads) -> Tensor");
  m.def("rope_write_kv(Tensor qk, Tensor v, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slots, int num_heads) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor seq_info, Tensor block_tables, float scale, Tensor(a!) out, int window=0, Tensor? sinks=None) -> ()");
  m.def("linear_bf16(Tensor x, Tensor wp, Tensor? bias, int amx_rows=0) -> Tensor");
  m.def("greedy_tokens(Tensor logits, Tensor? bitmask, int vocab_size, Tensor? rows=None) -> Tensor");
  m.def("has_bf16_gemm() -> bool", &has_bf16_gemm);
  m.def("bf16_gemm_isa() -> int", &bf16_gemm_isa);
  m.def("has_amx_bf16() -> bool", &has_amx_bf16);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("qk_rms_norm", &qk_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("greedy_tokens", &greedy_tokens);
}
