// tandem's CPU kernels: the small per-layer operations of a forward step, each fused into one pass over its data.
//
// On a CPU a decode step of a small model is bound by the count of operations, not by arithmetic: every torch op
// costs microseconds of dispatch and its own pass over memory. These kernels replace ~20 ops per layer with four:
//   add_rms_norm   x += delta; h = rms_norm(x) * w          (residual add, norm and cast in one pass)
//   rope_write_kv  rotate q and k, store k and v in the paged cache
//   paged_attention  causal attention of few queries per request read straight from the paged cache (no gather)
//   silu_mul       silu(gate) * up
// Registered as torch ops (`torch.ops.tandem.*`); built on first use by `tandem/runner/kernels.py`.
// Layouts: one layer's KV cache is float32 [2, KVH, num_blocks, block_size, D]; slot = block * block_size + offset.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", t, " is not supported (float32, bfloat16, float16)");
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x rounded to the storage type S and back: the kernels round where the reference implementation (torch ops in the
// model dtype) rounds, so fused and unfused forwards agree to the last bit in most places, not only within tolerance.
template <typename S>
inline float rnd(float x) {
  return static_cast<float>(static_cast<S>(x));
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
          for (int64_t i = 0; i < N; ++i) xr[i] += static_cast<float>(d[i]);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + feps);
        O* o = op + r * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) o[i] = static_cast<O>(xr[i] * inv * wp[i]);
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
        const S* u = g + I;
        S* o = op + r * I;
        for (int64_t i = 0; i < I; ++i) {
          const float gv = static_cast<float>(g[i]);
          o[i] = static_cast<S>(rnd<S>(gv / (1.f + std::exp(-gv))) * static_cast<float>(u[i]));  // silu rounded, as torch
        }
      }
    });
  });
  return out;
}

// ---- rope_write_kv ----
// qk [T, H + KVH, D] (heads contiguous, any row stride), v [T, KVH, D] (same), positions [T] int64,
// cos / sin [max_pos, D / 2] float32, kv_cache float32 [2, KVH, NB, BS, D], slots [T] int64.
// Returns rotated q and k as float32 [T, H + KVH, D]; writes rotated k and v at each token's slot.
// Rotate-half RoPE: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves of each head.
Tensor rope_write_kv(const Tensor& qk, const Tensor& v, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                     Tensor kv_cache, const Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "rope_write_kv: qk must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2), "rope_write_kv: v must be [T, KVH, D] with contiguous heads");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() && kv_cache.dim() == 5, "rope_write_kv: kv_cache must be contiguous float32 [2, KVH, NB, BS, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "rope_write_kv: cos / sin must be contiguous float32");
  TORCH_CHECK(qk.scalar_type() == v.scalar_type(), "rope_write_kv: qk and v must share a dtype");
  const int64_t T = qk.size(0), NH = qk.size(1), D = qk.size(2), KVH = v.size(1), half = D / 2;
  TORCH_CHECK(NH == num_heads + KVH && kv_cache.size(1) == KVH && kv_cache.size(4) == D && D % 2 == 0, "rope_write_kv: head counts do not match the cache");
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  Tensor out = at::empty({T, NH, D}, qk.options().dtype(at::kFloat));
  Tensor pos = positions.to(at::kLong).contiguous();
  Tensor sl = slots.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* cache = kv_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t max_pos = cos.size(0), max_slot = slots_per_head;
  dispatch_float(qk.scalar_type(), "rope_write_kv", [&](auto tag) {
    using S = decltype(tag);
    const S* qkp = qk.data_ptr<S>();
    const S* vp = v.data_ptr<S>();
    const int64_t qs = qk.stride(0), vs = v.stride(0);
    const int64_t grain = T * NH * D <= kSerialElems ? T : std::max<int64_t>(1, kSerialElems / (NH * D));
    at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = pp[t], slot = sp[t];
        TORCH_CHECK(p >= 0 && p < max_pos && slot >= 0 && slot < max_slot, "rope_write_kv: position or slot out of range");
        const float* c = cp + p * half;
        const float* s = snp + p * half;
        for (int64_t h = 0; h < NH; ++h) {
          const S* x = qkp + t * qs + h * D;
          float* o = op + (t * NH + h) * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            // rounded as the reference computes it in the model dtype: round(round(x cos) + round(rot(x) sin))
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            const float ci = c[i], si = s[i];
            o[i] = rnd<S>(rnd<S>(x1 * ci) + rnd<S>(-x2 * si));
            o[i + half] = rnd<S>(rnd<S>(x2 * ci) + rnd<S>(x1 * si));
          }
          if (h >= num_heads) {
            const int64_t kvh = h - num_heads;
            std::copy(o, o + D, cache + (kvh * slots_per_head + slot) * D);
            const S* vx = vp + t * vs + kvh * D;
            float* vc = cache + ((KVH + kvh) * slots_per_head + slot) * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) vc[i] = static_cast<float>(vx[i]);
          }
        }
      }
    });
  });
  return out;
}

// ---- paged_attention ----
// q float32 [T, H, D] (heads contiguous, any row stride); kv_cache float32 [2, KVH, NB, BS, D];
// seq_info int64 [B, 3] = (first row in T, number of queries n, tokens cached before them `start`);
// block_tables int64 [B, max_blocks]; out [T, H * D] (any float dtype), rows of the listed requests written.
// Query j of a request sits at position start + j and attends keys [0, start + j] (causal). Heads are grouped (GQA):
// query head h reads kv head h / G. One work item is (request, kv head): its n * G query rows read each key once.
void paged_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& seq_info, const Tensor& block_tables, double scale,
                     Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q must be float32 [T, H, D] with contiguous heads");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() && kv_cache.dim() == 5, "paged_attention: kv_cache must be contiguous float32 [2, KVH, NB, BS, D]");
  TORCH_CHECK(seq_info.scalar_type() == at::kLong && seq_info.is_contiguous() && seq_info.dim() == 2 && seq_info.size(1) == 3, "paged_attention: seq_info must be int64 [B, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2, "paged_attention: block_tables must be int64 [B, max_blocks]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == q.size(0) && out.numel() == q.size(0) * q.size(1) * q.size(2), "paged_attention: out must be contiguous [T, H * D]");
  const int64_t H = q.size(1), D = q.size(2), KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0 && kv_cache.size(4) == D, "paged_attention: head counts do not match the cache");
  const int64_t G = H / KVH, B = seq_info.size(0), MB = block_tables.size(1), qs = q.stride(0);
  const int64_t* info = seq_info.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* kc = kv_cache.data_ptr<float>();
  const float* vc = kc + KVH * NB * BS * D;
  const float fscale = static_cast<float>(scale);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = info[b * 3 + 1], start = info[b * 3 + 2];
    TORCH_CHECK(n >= 1 && start >= 0 && (start + n + BS - 1) / BS <= MB, "paged_attention: request ", b, " needs more blocks than its table holds");
    work += n * (start + n) * H * D;
  }
  dispatch_float(out.scalar_type(), "paged_attention out", [&](auto tag) {
    using O = decltype(tag);
    O* op = out.data_ptr<O>();
    at::parallel_for(0, B * KVH, work <= kSerialElems * 4 ? B * KVH : 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> scores, acc;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t b = w / KVH, kvh = w % KVH;
        const int64_t row0 = info[b * 3], n = info[b * 3 + 1], start = info[b * 3 + 2];
        const int64_t L = start + n, R = n * G;
        const int64_t* table = tables + b * MB;
        scores.assign(R * L, 0.f);
        acc.assign(R * D, 0.f);
        // scores[j * G + g, t] = q_(j, kvh * G + g) . k_t * scale for t <= start + j
        for (int64_t t = 0; t < L; ++t) {
          const float* k = kc + ((kvh * NB + table[t / BS]) * BS + t % BS) * D;
          for (int64_t j = std::max<int64_t>(0, t - start); j < n; ++j) {
            const float* qrow = qp + (row0 + j) * qs + kvh * G * D;
            for (int64_t g = 0; g < G; ++g) scores[(j * G + g) * L + t] = dot(qrow + g * D, k, D) * fscale;
          }
        }
        // softmax over each row's visible keys [0, start + j]
        for (int64_t r = 0; r < R; ++r) {
          const int64_t len = start + r / G + 1;
          float* s = scores.data() + r * L;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < len; ++t) {
            s[t] = std::exp(s[t] - m);
            sum += s[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        // acc[r] = sum_t p[r, t] v_t
        for (int64_t t = 0; t < L; ++t) {
          const float* v = vc + ((kvh * NB + table[t / BS]) * BS + t % BS) * D;
          for (int64_t r = std::max<int64_t>(0, t - start) * G; r < R; ++r) {
            const float p = scores[r * L + t];
            float* a = acc.data() + r * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += p * v[i];
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t j = r / G, g = r % G;
          O* o = op + (row0 + j) * H * D + (kvh * G + g) * D;
          const float* a = acc.data() + r * D;
          for (int64_t i = 0; i < D; ++i) o[i] = static_cast<O>(a[i]);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_write_kv(Tensor qk, Tensor v, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slots, int num_heads) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor seq_info, Tensor block_tables, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("paged_attention", &paged_attention);
}
