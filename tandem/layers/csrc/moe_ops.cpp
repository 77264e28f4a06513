// tandem's mixture-of-experts kernels around the expert projections (`tandem/layers/moe.py`), one pass each:
//   moe_route    h [T, hidden] and the router's weight [E, hidden] -> its logits -> each token's k experts and
//                weights, as (token, expert) pairs grouped by ascending expert (tokens ascending within an expert),
//                the experts used and their pair counts
//   moe_combine  the pairs' expert outputs scaled by their weights and added into their tokens' rows, in pair order
// Measured on two AVX-512 cores (AMD EPYC), Qwen3-30B-A3B's shape at batch 1: the torch operations these replace
// (the router's F.linear, softmax, top k, renormalise, sort, gather, scale, index_add: ~15 dispatches) cost ~0.3 ms a
// layer in the engine, a fifth of a layer's decode step, ~0.1 ms of it the router's 1 MB float32 GEMV through MKL;
// these take the GEMV's memory time and microseconds besides. The router's dot products are summed in one fixed order
// per token, so its logits do not depend on the other tokens of the step either (MKL's depend on the row count).
// Arithmetic follows the torch path (`MoeMlp.route`, `GptOssMoe.route`, `MoeMlp.combine`): float32 softmax, weights
// rounded once to the logits' dtype, each product rounded to the output dtype and the sums taken in pair order, so a
// token's result depends on its own pairs only, never on the other tokens of the step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "float_types.h"

// No fused multiply-adds but the explicit ones: the compiler would contract some loops and not others (the router's
// 4-token and 1-token sums would then differ), and moe_combine rounds its product and sum apart as torch's two ops do.
#pragma GCC optimize("fp-contract=off")

namespace {

using at::Tensor;

using tandem_kernels::dispatch_float;

// v rounded to T and back (identity for float32): what a torch op computing in float32 and storing T keeps
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One token's router logits l [E] -> its k experts ids [k] (ranked, ties to the lower id; NaN ranks first as in
// torch.topk) and their weights w [k] in float32 before the final rounding. softmax_after_topk (gpt-oss): the top k
// logits softmaxed among themselves; otherwise (Qwen3-MoE, Mixtral) a softmax over all E, its top k, renormalised to
// sum to 1 when `renormalize`.
void route_token(const float* l, int64_t E, int64_t k, bool renormalize, bool softmax_after_topk, std::vector<float>& p,
                 std::vector<int64_t>& order, int64_t* ids, float* w) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < E; ++e) {
    p[e] = l[e];
    m = std::max(m, p[e]);
  }
  if (!softmax_after_topk) {
    float s = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(p[e] - m);
      s += p[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] /= s;
  }
  std::iota(order.begin(), order.end(), int64_t{0});
  auto key = [&](int64_t e) { return std::isnan(p[e]) ? std::numeric_limits<float>::infinity() : p[e]; };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  });
  for (int64_t j = 0; j < k; ++j) ids[j] = order[j];
  if (softmax_after_topk) {  // in the logits' dtype, as torch.softmax(top, dtype=top.dtype): float32 inside, one rounding
    const float top = p[order[0]];
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      w[j] = std::exp(p[order[j]] - top);
      s += w[j];
    }
    for (int64_t j = 0; j < k; ++j) w[j] /= s;
    return;
  }
  float s = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    w[j] = p[order[j]];
    s += w[j];
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) w[j] /= s;
}

// NT tokens' dot products with one router row w [K]: each token's terms summed in 16 lanes (fused multiply-adds), the
// lanes then added in order, the same order whatever NT (so a token's logit does not depend on the tokens computed
// beside it). AVX-512 loads 16 values a step (bf16 widened by a shift); the scalar loop keeps the same lanes.
#if defined(__AVX512F__)
using tandem_kernels::load16;
#endif

template <int NT, int NE, typename S>
inline void router_dots(const S* const* xs, const S* const* ws, int64_t K, float (*out)[NE]) {
  float part[NT][NE][16] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[NT][NE];
  for (int n = 0; n < NT; ++n)
    for (int e = 0; e < NE; ++e) acc[n][e] = _mm512_setzero_ps();
  for (; i + 16 <= K; i += 16) {
    __m512 wv[NE];
    for (int e = 0; e < NE; ++e) wv[e] = load16(ws[e] + i);
    for (int n = 0; n < NT; ++n) {
      const __m512 xv = load16(xs[n] + i);
      for (int e = 0; e < NE; ++e) acc[n][e] = _mm512_fmadd_ps(xv, wv[e], acc[n][e]);
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int e = 0; e < NE; ++e) _mm512_storeu_ps(part[n][e], acc[n][e]);
#else
  for (; i + 16 <= K; i += 16)
    for (int n = 0; n < NT; ++n)
      for (int e = 0; e < NE; ++e)
        for (int j = 0; j < 16; ++j)
          part[n][e][j] = std::fma(static_cast<float>(xs[n][i + j]), static_cast<float>(ws[e][i + j]), part[n][e][j]);
#endif
  for (int n = 0; n < NT; ++n)
    for (int e = 0; e < NE; ++e) {
      float tail = 0.f;
      for (int64_t r = i; r < K; ++r) tail = std::fma(static_cast<float>(xs[n][r]), static_cast<float>(ws[e][r]), tail);
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += part[n][e][j];
      out[n][e] = sum + tail;
    }
}

// NE router rows from expert e against every token: NT tokens at a time (each x load serves NE rows, each w load NT
// tokens: 4 x 4 keeps the FMAs fed from L1 / L2), then the tokens left one by one.
template <int NE, typename S>
void router_rows(const S* h, const S* W, const S* b, int64_t T, int64_t E, int64_t K, int64_t e, float* logits) {
  constexpr int NT = 4;
  const S* ws[NE];
  float bias[NE];
  for (int j = 0; j < NE; ++j) {
    ws[j] = W + (e + j) * K;
    bias[j] = b ? static_cast<float>(b[e + j]) : 0.f;
  }
  float dots[NT][NE];
  int64_t t = 0;
  for (; t + NT <= T; t += NT) {
    const S* xs[NT];
    for (int n = 0; n < NT; ++n) xs[n] = h + (t + n) * K;
    router_dots<NT, NE>(xs, ws, K, dots);
    for (int n = 0; n < NT; ++n)
      for (int j = 0; j < NE; ++j) logits[(t + n) * E + e + j] = round_to<S>(dots[n][j] + bias[j]);
  }
  for (; t < T; ++t) {
    const S* xs[1] = {h + t * K};
    router_dots<1, NE>(xs, ws, K, dots);
    for (int j = 0; j < NE; ++j) logits[t * E + e + j] = round_to<S>(dots[0][j] + bias[j]);
  }
}

// h [T, K], W [E, K], b [E] or null -> logits [T, E] float32 holding values of S: x @ W^T + b, rounded once to S as
// torch's linear stores them. Experts are split across threads in groups of 4; each reads its rows once for all tokens.
template <typename S>
void router_logits(const S* h, const S* W, const S* b, int64_t T, int64_t E, int64_t K, float* logits) {
  constexpr int NE = 4;
  const int64_t groups = (E + NE - 1) / NE;
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t e = g * NE;
      if (e + NE <= E) {
        router_rows<NE>(h, W, b, T, E, K, e, logits);
      } else {
        for (int64_t r = e; r < E; ++r) router_rows<1>(h, W, b, T, E, K, r, logits);
      }
    }
  });
}

// h [T, hidden], weight [E, hidden], bias [E] or None (all in the model dtype) -> (tokens [P] int64, scale [P] in the
// model dtype, plan [2, U] int64), P = T k: pair i is token tokens[i]'s choice of the expert whose group it lies in;
// plan[0] the U experts chosen by any token, ascending, plan[1] their pair counts (the groups, in that order,
// partition the pairs).
std::tuple<Tensor, Tensor, Tensor> moe_route(const Tensor& h, const Tensor& weight, const std::optional<Tensor>& bias,
                                             int64_t k, bool renormalize, bool softmax_after_topk) {
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 2 && h.size(1) == weight.size(1), "moe_route: h [T, K], weight [E, K]");
  TORCH_CHECK(h.scalar_type() == weight.scalar_type(), "moe_route: h and weight must share a dtype");
  const Tensor x = h.contiguous(), W = weight.contiguous();
  Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == W.size(0) && b.scalar_type() == W.scalar_type(), "moe_route: bias [E]");
  }
  const int64_t T = x.size(0), E = W.size(0), K = W.size(1), P = T * k;
  TORCH_CHECK(k > 0 && k <= E, "moe_route: k must be in [1, ", E, "], got ", k);
  std::vector<float> logits(T * E);
  std::vector<int64_t> ids(P);
  std::vector<float> w(P);
  std::vector<float> p(E);
  std::vector<int64_t> order(E);
  dispatch_float(x.scalar_type(), "moe_route", [&](auto zero) {
    using S = decltype(zero);
    router_logits(x.data_ptr<S>(), W.data_ptr<S>(), b.defined() ? b.data_ptr<S>() : nullptr, T, E, K, logits.data());
  });
  for (int64_t t = 0; t < T; ++t)
    route_token(logits.data() + t * E, E, k, renormalize, softmax_after_topk, p, order, ids.data() + t * k, w.data() + t * k);
  // counting sort by expert; walking the pairs in token order keeps tokens ascending within each expert's group
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < P; ++i) ++start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  Tensor tokens = at::empty({P}, x.options().dtype(at::kLong));
  Tensor scale = at::empty({P}, x.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  dispatch_float(x.scalar_type(), "moe_route", [&](auto zero) {
    using S = decltype(zero);
    S* sc = scale.data_ptr<S>();
    for (int64_t i = 0; i < P; ++i) {
      const int64_t slot = next[ids[i]]++;
      tok[slot] = i / k;
      sc[slot] = static_cast<S>(w[i]);
    }
  });
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  const int64_t U = static_cast<int64_t>(used.size());
  Tensor plan = at::empty({2, U}, x.options().dtype(at::kLong));
  int64_t* pl = plan.data_ptr<int64_t>();
  for (int64_t u = 0; u < U; ++u) {
    pl[u] = used[u];
    pl[U + u] = start[used[u] + 1] - start[used[u]];
  }
  return {tokens, scale, plan};
}

// y [P, H] (the pairs' expert outputs, in moe_route's order), scale [P], tokens [P] -> out [T, H] in y's dtype:
// out[tokens[i]] += y[i] * scale[i] for i in order from zero, as torch's `zeros.index_add_(0, tokens, y * scale[:, None])`
// computes it: each product rounded to the dtype, the sums kept in float32 and rounded once at the end (torch's
// index_add_ accumulates bf16 / f16 in float32). Columns are split across threads; each walks every pair in order.
Tensor moe_combine(const Tensor& y, const Tensor& scale, const Tensor& tokens, int64_t T) {
  TORCH_CHECK(y.dim() == 2 && scale.dim() == 1 && tokens.dim() == 1, "moe_combine: y [P, H], scale [P], tokens [P]");
  TORCH_CHECK(y.size(0) == scale.size(0) && y.size(0) == tokens.size(0), "moe_combine: y, scale and tokens disagree on P");
  TORCH_CHECK(scale.scalar_type() == y.scalar_type() && tokens.scalar_type() == at::kLong, "moe_combine: dtypes");
  const Tensor yc = y.contiguous(), sc = scale.contiguous(), tc = tokens.contiguous();
  const int64_t P = yc.size(0), H = yc.size(1);
  Tensor acc = at::zeros({T, H}, yc.options().dtype(at::kFloat));
  const int64_t* tok = tc.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < T, "moe_combine: token ", tok[i], " out of range");
  dispatch_float(yc.scalar_type(), "moe_combine", [&](auto zero) {
    using S = decltype(zero);
    const S* ys = yc.data_ptr<S>();
    const S* ss = sc.data_ptr<S>();
    float* o = acc.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(P, 1));  // ~32k multiply-adds a task
    at::parallel_for(0, H, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t i = 0; i < P; ++i) {
        const float s = static_cast<float>(ss[i]);
        const S* yi = ys + i * H;
        float* oi = o + tok[i] * H;
        for (int64_t c = c0; c < c1; ++c) oi[c] += round_to<S>(static_cast<float>(yi[c]) * s);
      }
    });
  });
  return yc.scalar_type() == at::kFloat ? acc : acc.to(yc.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("moe_route(Tensor h, Tensor weight, Tensor? bias, int k, bool renormalize, bool softmax_after_topk) -> (Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y, Tensor scale, Tensor tokens, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_combine", &moe_combine);
}
