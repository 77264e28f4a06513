// A decoder's decode and verify steps as one call: `DecodeStack` holds every layer's weights (as the Python
// projections hold them, shared, not copied) and runs each layer's kernels in the order `LlamaModel.forward` calls
// them from Python, through the dispatcher's typed handles:
//   add_rms_norm -> qkv -> [qk_rms_norm] -> rope_write_kv -> paged_attention -> o -> add_rms_norm -> gate_up ->
//   silu_mul -> down, and the final add_rms_norm; a mixture-of-experts layer's MLP as `MoeMlp` runs it: moe_route ->
//   index_select -> quant_grouped (the chosen experts' gate / ups) -> silu_mul, or gpt-oss's clamped SwiGLU as
//   `GptOssMoe.activation` computes it (the same ATen operations) -> quant_grouped (their downs) -> moe_combine.
// The same kernels on the same inputs in the same order: the hidden states are bit-identical to the Python loop's.
// What goes away is the Python between them: ~5 us a projection call (its argument lists converted every call),
// ~3 us a layer operation, the views and slices; at batch 1 ~1.5 ms of a ~6 ms step of SmolLM2-135M (30 layers, 9
// calls each) on two AVX-512 cores, where llama.cpp has none.
//
//   DecodeStack(num_heads, num_kv_heads, head_dim, eps, scale, dtype, cos, sin, silu_rows)
//   add_projection(kind, packed, fmts, ns, bias, isa, amx_rows) -> id   kind 0: quant_linear(x, packed, fmts, ns, bias,
//                                                                      isa, amx_rows); 1: linear_bf16(x, packed[0],
//                                                                      bias, amx_rows)
//   add_moe(router_weight, router_bias, top_k, renormalize, softmax_after_topk, isa, amx_rows, activation, alpha,
//           limit) -> id                                               activation 0: SiLU; 1: clamped SwiGLU
//   add_expert(moe, gate_up_packed, gate_up_fmts, gate_up_ns, gate_up_biases, down_packed, down_fmts, down_ns,
//              down_biases)                                            experts in id order; biases: one a part or none
//   add_layer(input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, window, sinks, moe)   moe -1: dense MLP
//                                                                      (gate_up, down), else those are -1
//   set_norm(norm)
//   forward(x, kv_caches, positions, slots, seq_info, block_tables) -> hidden
// x: float32 [T, hidden], the embedded tokens, updated in place as the residual stream (as in Python); returns the
// final normed hidden states [T, hidden] in `dtype`. Every token must be in the paged decode group (seq_info,
// block_tables: no prefill rows); silu_rows: from this many tokens in the step torch's SiLU runs instead of the
// kernel's (as CpuKernelOps.silu_mul decides: by the step's tokens, not a MoE layer's pairs).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

using at::Tensor;

struct Projection {
  int64_t kind;  // 0: quant_linear, 1: linear_bf16
  std::vector<Tensor> packed;
  std::vector<int64_t> fmts, ns;
  c10::optional<Tensor> bias;
  int64_t isa, amx_rows;
};

struct Segments {  // one expert projection's packed parts, stacked along N, and their biases (one a part, or none)
  std::vector<Tensor> packed, biases;
  std::vector<int64_t> fmts, ns;
};

struct Moe {
  Tensor router_weight;
  c10::optional<Tensor> router_bias;
  int64_t top_k;
  bool renormalize, softmax_after_topk;
  int64_t isa, amx_rows, activation;
  double alpha, limit;
  std::vector<Segments> gate_ups, downs;  // [expert]
};

struct Layer {
  Tensor input_norm, post_norm;
  c10::optional<Tensor> q_norm, k_norm, sinks;
  int64_t qkv, o, gate_up, down, window, moe;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Kernels {
  c10::TypedOperatorHandle<Tensor(Tensor, const c10::optional<Tensor>&, const Tensor&, double, at::ScalarType)> add_rms_norm =
      op<Tensor(Tensor, const c10::optional<Tensor>&, const Tensor&, double, at::ScalarType)>("tandem::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul = op<Tensor(const Tensor&)>("tandem::silu_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, double, int64_t)> qk_rms_norm =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, double, int64_t)>("tandem::qk_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, const Tensor&, int64_t)>
      rope_write_kv = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, const Tensor&, int64_t)>(
          "tandem::rope_write_kv");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, Tensor, int64_t, const c10::optional<Tensor>&)>
      paged_attention = op<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, Tensor, int64_t, const c10::optional<Tensor>&)>(
          "tandem::paged_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t)> linear_bf16 =
      op<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t)>("tandem::linear_bf16");
  c10::TypedOperatorHandle<Tensor(const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const c10::optional<Tensor>&, int64_t, int64_t)>
      quant_linear = op<Tensor(const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const c10::optional<Tensor>&, int64_t, int64_t)>(
          "tandem::quant_linear");
  using Grouped = Tensor(const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                         at::IntArrayRef, at::TensorList, int64_t, int64_t);
  c10::TypedOperatorHandle<Grouped> quant_grouped = op<Grouped>("tandem::quant_grouped");
  using Route = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t, bool, bool);
  c10::TypedOperatorHandle<Route> moe_route = op<Route>("tandem::moe_route");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)> moe_combine =
      op<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>("tandem::moe_combine");
};

at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  TORCH_CHECK(false, "DecodeStack: dtype must be float32, bfloat16 or float16, got ", name);
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t H, KVH, D;
  double eps, scale;
  at::ScalarType dtype;
  Tensor cos, sin;
  int64_t silu_rows;
  std::vector<Projection> projections;
  std::vector<Layer> layers;
  std::vector<Moe> moes;
  Tensor norm;
  Kernels k;

  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps_, double scale_, std::string dtype_name,
              Tensor cos_, Tensor sin_, int64_t silu_rows_)
      : H(num_heads), KVH(num_kv_heads), D(head_dim), eps(eps_), scale(scale_), dtype(dtype_named(dtype_name)),
        cos(std::move(cos_)), sin(std::move(sin_)), silu_rows(silu_rows_) {}

  int64_t add_projection(int64_t kind, std::vector<Tensor> packed, std::vector<int64_t> fmts, std::vector<int64_t> ns,
                         c10::optional<Tensor> bias, int64_t isa, int64_t amx_rows) {
    TORCH_CHECK(kind == 0 || kind == 1, "DecodeStack: projection kind must be 0 (quantized) or 1 (bf16 GEMM)");
    TORCH_CHECK(!packed.empty() && (kind == 1 || (packed.size() == fmts.size() && packed.size() == ns.size())),
                "DecodeStack: a projection needs its packed parts (and a format and N for each quantized one)");
    projections.push_back({kind, std::move(packed), std::move(fmts), std::move(ns), std::move(bias), isa, amx_rows});
    return static_cast<int64_t>(projections.size()) - 1;
  }

  int64_t add_moe(Tensor router_weight, c10::optional<Tensor> router_bias, int64_t top_k, bool renormalize,
                  bool softmax_after_topk, int64_t isa, int64_t amx_rows, int64_t activation, double alpha, double limit) {
    TORCH_CHECK(router_weight.dim() == 2 && top_k > 0 && top_k <= router_weight.size(0),
                "DecodeStack: a router [E, hidden] and 0 < top_k <= E");
    TORCH_CHECK(activation == 0 || activation == 1, "DecodeStack: activation 0 (SiLU) or 1 (clamped SwiGLU)");
    moes.push_back({std::move(router_weight), std::move(router_bias), top_k, renormalize, softmax_after_topk, isa, amx_rows,
                    activation, alpha, limit, {}, {}});
    return static_cast<int64_t>(moes.size()) - 1;
  }

  static Segments segments(std::vector<Tensor> packed, std::vector<int64_t> fmts, std::vector<int64_t> ns,
                           std::vector<Tensor> biases) {
    TORCH_CHECK(!packed.empty() && packed.size() == fmts.size() && packed.size() == ns.size() &&
                    (biases.empty() || biases.size() == packed.size()),
                "DecodeStack: an expert projection needs its packed parts, a format and N for each, and a bias for each or none");
    return {std::move(packed), std::move(biases), std::move(fmts), std::move(ns)};
  }

  void add_expert(int64_t moe, std::vector<Tensor> gu_packed, std::vector<int64_t> gu_fmts, std::vector<int64_t> gu_ns,
                  std::vector<Tensor> gu_biases, std::vector<Tensor> dn_packed, std::vector<int64_t> dn_fmts,
                  std::vector<int64_t> dn_ns, std::vector<Tensor> dn_biases) {
    TORCH_CHECK(moe >= 0 && moe < static_cast<int64_t>(moes.size()), "DecodeStack: unknown MoE layer ", moe);
    Moe& m = moes[moe];
    m.gate_ups.push_back(segments(std::move(gu_packed), std::move(gu_fmts), std::move(gu_ns), std::move(gu_biases)));
    m.downs.push_back(segments(std::move(dn_packed), std::move(dn_fmts), std::move(dn_ns), std::move(dn_biases)));
    const bool biased = !m.gate_ups.front().biases.empty();
    TORCH_CHECK(!m.gate_ups.back().biases.empty() == biased && !m.downs.back().biases.empty() == biased &&
                    !m.downs.front().biases.empty() == biased,
                "DecodeStack: a layer's experts have biases on every projection or on none");
  }

  void add_layer(Tensor input_norm, int64_t qkv, c10::optional<Tensor> q_norm, c10::optional<Tensor> k_norm, int64_t o,
                 Tensor post_norm, int64_t gate_up, int64_t down, int64_t window, c10::optional<Tensor> sinks, int64_t moe) {
    const auto n = static_cast<int64_t>(projections.size());
    for (int64_t id : {qkv, o}) TORCH_CHECK(id >= 0 && id < n, "DecodeStack: unknown projection ", id);
    if (moe < 0) {
      for (int64_t id : {gate_up, down}) TORCH_CHECK(id >= 0 && id < n, "DecodeStack: unknown projection ", id);
    } else {
      TORCH_CHECK(moe < static_cast<int64_t>(moes.size()) && !moes[moe].gate_ups.empty() &&
                      moes[moe].top_k <= static_cast<int64_t>(moes[moe].gate_ups.size()) &&
                      moes[moe].router_weight.size(0) == static_cast<int64_t>(moes[moe].gate_ups.size()),
                  "DecodeStack: MoE layer ", moe, " is unknown or lacks experts (one per router row)");
    }
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStack: q and k norms come together");
    layers.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), std::move(sinks), qkv, o,
                      gate_up, down, window, moe});
  }

  void set_norm(Tensor norm_) { norm = std::move(norm_); }

  Tensor project(int64_t id, const Tensor& x) const {
    const Projection& p = projections[id];
    if (p.kind == 1) return k.linear_bf16.call(x.contiguous(), p.packed[0], p.bias, p.amx_rows);
    return k.quant_linear.call(x.contiguous(), p.packed, p.fmts, p.ns, p.bias, p.isa, p.amx_rows);
  }

  Tensor silu(const Tensor& gu, int64_t tokens) const {
    if (tokens < silu_rows) return k.silu_mul.call(gu);
    const auto halves = gu.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }

  // GroupedProjections.__call__: x's rows grouped by the experts in `plan` ([2, U]: expert ids, then their row counts)
  Tensor grouped(const Moe& m, const std::vector<Segments>& experts, const Tensor& x, const Tensor& plan) const {
    const int64_t U = plan.size(1);
    const int64_t* pl = plan.data_ptr<int64_t>();
    std::vector<Tensor> packed, biases;
    std::vector<int64_t> fmts, ns, cols, row0, row1;
    int64_t start = 0;
    for (int64_t u = 0; u < U; ++u) {
      const int64_t e = pl[u], rows = pl[U + u];
      if (rows > 0) {
        const Segments& sg = experts[e];
        int64_t col = 0;
        for (size_t i = 0; i < sg.packed.size(); ++i) {
          packed.push_back(sg.packed[i]);
          if (!sg.biases.empty()) biases.push_back(sg.biases[i]);
          fmts.push_back(sg.fmts[i]);
          ns.push_back(sg.ns[i]);
          cols.push_back(col);
          row0.push_back(start);
          row1.push_back(start + rows);
          col += sg.ns[i];
        }
      }
      start += rows;
    }
    return k.quant_grouped.call(x.contiguous(), packed, fmts, ns, cols, row0, row1, biases, m.isa, m.amx_rows);
  }

  // MoeMlp.activation / GptOssMoe.activation: gu [P, 2 I] -> [P, I]
  Tensor activate(const Moe& m, const Tensor& gu, int64_t tokens) const {
    if (m.activation == 0) return silu(gu, tokens);
    const auto halves = gu.chunk(2, -1);
    const Tensor gate = halves[0].clamp_max(m.limit);
    const Tensor up = halves[1].clamp(-m.limit, m.limit);
    return (up + 1) * (gate * at::sigmoid(gate * m.alpha));
  }

  Tensor mlp(const Layer& l, const Tensor& h, int64_t T) const {
    if (l.moe < 0) return project(l.down, silu(project(l.gate_up, h), T));
    const Moe& m = moes[l.moe];
    const auto [tokens, scale, plan] = k.moe_route.call(h, m.router_weight, m.router_bias, m.top_k, m.renormalize,
                                                        m.softmax_after_topk);  // pairs grouped by expert
    const Tensor x = h.index_select(0, tokens);  // [P, hidden]
    const Tensor y = grouped(m, m.downs, activate(m, grouped(m, m.gate_ups, x, plan), T), plan);  // [P, hidden]
    return k.moe_combine.call(y, scale, tokens, T);
  }

  Tensor forward(Tensor x, std::vector<Tensor> kv_caches, Tensor positions, Tensor slots, Tensor seq_info, Tensor block_tables) {
    TORCH_CHECK(norm.defined(), "DecodeStack: set_norm was not called");
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack: one KV cache per layer, got ", kv_caches.size(), " for ",
                layers.size());
    at::NoGradGuard no_grad;
    const int64_t T = x.size(0), q_kv = (H + KVH) * D;
    c10::optional<Tensor> delta;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      Tensor h = k.add_rms_norm.call(x, delta, l.input_norm, eps, dtype);
      const Tensor qkv = project(l.qkv, h);  // [T, (H + 2 KVH) D]
      Tensor qk = qkv.narrow(1, 0, q_kv).view({T, H + KVH, D});
      const Tensor v = qkv.narrow(1, q_kv, KVH * D).view({T, KVH, D});
      if (l.q_norm.has_value()) qk = k.qk_rms_norm.call(qk, *l.q_norm, *l.k_norm, eps, H);
      qk = k.rope_write_kv.call(qk, v, positions, cos, sin, kv_caches[i], slots, H);  // [T, H + KVH, D] float32
      Tensor attn = at::empty({T, H * D}, x.options().dtype(dtype));
      k.paged_attention.call(qk.narrow(1, 0, H), kv_caches[i], seq_info, block_tables, scale, attn, l.window, l.sinks);
      h = k.add_rms_norm.call(x, project(l.o, attn), l.post_norm, eps, dtype);
      delta = mlp(l, h, T);  // [T, hidden]
    }
    return k.add_rms_norm.call(x, delta, norm, eps, dtype);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, Tensor, Tensor, int64_t>())
      .def("add_projection", &DecodeStack::add_projection)
      .def("add_moe", &DecodeStack::add_moe)
      .def("add_expert", &DecodeStack::add_expert)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_norm", &DecodeStack::set_norm)
      .def("forward", &DecodeStack::forward);
}
