// A step's launch inputs in one call (`tandem/layers/attention.py: step_inputs` on FlexAttention's paged decode path,
// a CUDA runner's eager steps): from a plan's per-row arrays (core/plan_arrays.PlanRows) to the token positions, KV
// slots and logits rows of every row, the decode group's query indices and the paged view's tables.
//   step_inputs  starts, counts, wanted, used [B] int64, blocks [sum(used)] int64 (each row's first `used` blocks),
//                block_size, decode_max_query -> positions, slots [T], logits rows [R], the prefill rows [P], then
//                the decode group's (Bd rows): token_index [Bd * q_max], flat_index, out_rows [n], query_pos
//                [Bd, q_max], seq_info [Bd, 3], block tables [Bd, b_max] int64, blocks held [Bd] int32, block tables
//                int32: equal to the NumPy expressions they replace
// Measured on an AMD EPYC core (Zen 4, 2026-12-06, `python scripts/bench_launch_inputs.py [--cold]`, "eager: paged"
// at 256 verify rows, the plan's read included): 0.57-0.59 ms with the NumPy path (~100 calls), 0.41-0.44 with this
// one; after the host's sampling has streamed a step's logits through the caches (each NumPy call then costs ~10x)
// 1.25 against 0.87-0.88 ms: host time the device waits for between sampling and the launch.
//   plan_patch   a plan's arrays as read ahead (starts, counts, wanted, used [B], ids [T], blocks [sum(used)]) and
//                its edits since (core/plan_arrays.InputsAhead): `edits` [F * 3 + sum(5 + n + u)] int64, F then the
//                fed (row, index in its ids, token) and the reshaped rows read again, ascending, each (row, start,
//                n, wanted, u, its n ids, its u blocks), or (row, start, n, wanted, -u, its n ids) for a row that
//                keeps the first u of the blocks it was read with (a row settled to one token: its record has no
//                block ids to read from Python objects at the launch) -> the six arrays of the plan now. A plan read again in
//                Python took 0.2-0.3 ms of the launch (its rows' objects and ~10 NumPy calls after the host's
//                sampling had flushed the caches).
//   plan_patch_step  plan_patch, then step_inputs on the patched arrays, and the CUDA graph's q of the
//                patched plan (`runner/cuda_graphs.graph_query_len`; 0: no graph's shape) -> (6 + 12 tensors, q). A
//                reshaped plan's launch in one call of the library instead of three steps (plan_patch, the graph
//                check in NumPy, step_inputs): after the host's sampling has flushed the caches each call into torch
//                and each NumPy call costs ~10x its warm time. 256 verify rows, a row reshaped: 0.50 -> 0.40 ms cold
//                (AMD EPYC Zen 4, 2026-12-06, `python scripts/bench_launch_inputs.py --cold`).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// The decode rows (1 <= counts[i] <= decode_max_query, starts[i] > 0) form the decode group; the others are prefill
// rows, whose positions, slots and logits rows are here too (the caller builds their PrefillSeq from prefill_rows).
std::vector<at::Tensor> step_inputs(const at::Tensor& starts_in, const at::Tensor& counts_in,
                                    const at::Tensor& wanted_in, const at::Tensor& used_in,
                                    const at::Tensor& blocks_in, int64_t block_size, int64_t decode_max_query) {
  const at::Tensor starts = starts_in.contiguous(), counts = counts_in.contiguous(), wanted = wanted_in.contiguous();
  const at::Tensor used = used_in.contiguous(), blocks = blocks_in.contiguous();
  const int64_t B = starts.size(0);
  TORCH_CHECK(counts.size(0) == B && wanted.size(0) == B && used.size(0) == B, "one value per row");
  const auto* s = starts.data_ptr<int64_t>();
  const auto* c = counts.data_ptr<int64_t>();
  const auto* w = wanted.data_ptr<int64_t>();
  const auto* u = used.data_ptr<int64_t>();
  const auto* bl = blocks.data_ptr<int64_t>();
  int64_t T = 0, R = 0, q_max = 0, b_max = 0, held = 0, Bd = 0;
  std::vector<char> decode(B);
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(u[i] >= 1 && w[i] <= c[i] && (s[i] + c[i] + block_size - 1) / block_size <= u[i], "row ", i);
    decode[i] = c[i] >= 1 && c[i] <= decode_max_query && s[i] > 0;
    T += c[i];
    R += w[i];
    held += u[i];
    if (decode[i]) {
      ++Bd;
      q_max = std::max(q_max, c[i]);
      b_max = std::max(b_max, u[i]);
    }
  }
  TORCH_CHECK(blocks.size(0) == held, "blocks: each row's first `used`");
  const auto i64 = at::TensorOptions().dtype(at::kLong), i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor positions = at::empty({T}, i64), slots = at::empty({T}, i64), logits_rows = at::empty({R}, i64);
  at::Tensor prefill_rows = at::empty({B - Bd}, i64), token_index = at::empty({Bd * q_max}, i64);
  at::Tensor flat_index = at::empty({T}, i64), out_rows = at::empty({T}, i64), query_pos = at::empty({Bd, q_max}, i64);
  at::Tensor seq_info = at::empty({Bd, 3}, i64), tables = at::empty({Bd, b_max}, i64), num_blocks = at::empty({Bd}, i32);
  at::Tensor tables32 = at::empty({Bd, b_max}, i32);
  auto* pos = positions.data_ptr<int64_t>();
  auto* slot = slots.data_ptr<int64_t>();
  auto* lr = logits_rows.data_ptr<int64_t>();
  auto* pr = prefill_rows.data_ptr<int64_t>();
  auto* ti = token_index.data_ptr<int64_t>();
  auto* fi = flat_index.data_ptr<int64_t>();
  auto* orow = out_rows.data_ptr<int64_t>();
  auto* qp = query_pos.data_ptr<int64_t>();
  auto* si = seq_info.data_ptr<int64_t>();
  auto* tb = tables.data_ptr<int64_t>();
  auto* nb = num_blocks.data_ptr<int32_t>();
  auto* tb32 = tables32.data_ptr<int32_t>();
  int64_t offset = 0, first_block = 0, r = 0, real = 0, d = 0, p = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t n = c[i], start = s[i], row_held = u[i];
    const int64_t* row_blocks = bl + first_block;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at_pos = start + j;
      pos[offset + j] = at_pos;
      slot[offset + j] = row_blocks[at_pos / block_size] * block_size + at_pos % block_size;
    }
    for (int64_t j = n - w[i]; j < n; ++j) lr[r++] = offset + j;
    if (!decode[i]) {
      pr[p++] = i;
    } else {
      for (int64_t j = 0; j < b_max; ++j) {  // the row's blocks, then its last one repeated
        const int64_t b = row_blocks[std::min(j, row_held - 1)];
        tb[d * b_max + j] = b;
        tb32[d * b_max + j] = static_cast<int32_t>(b);
      }
      for (int64_t j = 0; j < q_max; ++j) {  // padding queries repeat the row's last
        const int64_t k = std::min(j, n - 1);
        qp[d * q_max + j] = start + k;
        ti[d * q_max + j] = offset + k;
        if (j < n) {
          fi[real] = d * q_max + j;
          orow[real++] = offset + j;
        }
      }
      si[d * 3] = offset;
      si[d * 3 + 1] = n;
      si[d * 3 + 2] = start;
      nb[d++] = static_cast<int32_t>(row_held);
    }
    offset += n;
    first_block += row_held;
  }
  flat_index = flat_index.narrow(0, 0, real);
  out_rows = out_rows.narrow(0, 0, real);
  return {positions, slots, logits_rows, prefill_rows, token_index, flat_index, out_rows, query_pos, seq_info, tables,
          num_blocks, tables32};
}

// The arrays of a plan read ahead, its fed tokens written and its reshaped rows put in (see the header).
std::vector<at::Tensor> plan_patch(const at::Tensor& starts_in, const at::Tensor& counts_in,
                                   const at::Tensor& wanted_in, const at::Tensor& used_in, const at::Tensor& ids_in,
                                   const at::Tensor& blocks_in, const at::Tensor& edits_in) {
  const at::Tensor starts = starts_in.contiguous(), counts = counts_in.contiguous(), wanted = wanted_in.contiguous();
  const at::Tensor used = used_in.contiguous(), ids = ids_in.contiguous(), blocks = blocks_in.contiguous();
  const at::Tensor edits = edits_in.contiguous();
  const int64_t B = starts.size(0), E = edits.size(0);
  TORCH_CHECK(counts.size(0) == B && wanted.size(0) == B && used.size(0) == B, "one value per row");
  const auto* c = counts.data_ptr<int64_t>();
  const auto* u = used.data_ptr<int64_t>();
  const auto* old_ids = ids.data_ptr<int64_t>();
  const auto* old_blocks = blocks.data_ptr<int64_t>();
  const auto* e = edits.data_ptr<int64_t>();
  TORCH_CHECK(E >= 1 && e[0] >= 0 && 1 + 3 * e[0] <= E, "edits: the fed count first");
  const int64_t F = e[0];
  at::Tensor out_starts = starts.clone(), out_counts = counts.clone(), out_wanted = wanted.clone();
  at::Tensor out_used = used.clone();
  auto* s2 = out_starts.data_ptr<int64_t>();
  auto* c2 = out_counts.data_ptr<int64_t>();
  auto* w2 = out_wanted.data_ptr<int64_t>();
  auto* u2 = out_used.data_ptr<int64_t>();
  std::vector<int64_t> record(B, -1);  // where row i's record starts in `edits` (-1: as read)
  int64_t T = ids.size(0), H = blocks.size(0);
  for (int64_t q = 1 + 3 * F; q < E;) {
    TORCH_CHECK(q + 5 <= E, "edits: a record cut short");
    const int64_t i = e[q], n = e[q + 2];
    const bool kept = e[q + 4] < 0;  // the row's first blocks as read, none in the record
    const int64_t rows_used = kept ? -e[q + 4] : e[q + 4], listed = kept ? 0 : rows_used;
    TORCH_CHECK(i >= 0 && i < B && record[i] < 0 && n >= 1 && rows_used >= 1 && q + 5 + n + listed <= E,
                "edits: row ", i);
    TORCH_CHECK(!kept || rows_used <= u[i], "edits: row ", i, " keeps more blocks than it was read with");
    record[i] = q;
    T += n - c[i];
    H += rows_used - u[i];
    s2[i] = e[q + 1];
    c2[i] = n;
    w2[i] = e[q + 3];
    u2[i] = rows_used;
    q += 5 + n + listed;
  }
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor out_ids = at::empty({T}, i64), out_blocks = at::empty({H}, i64);
  auto* id2 = out_ids.data_ptr<int64_t>();
  auto* bl2 = out_blocks.data_ptr<int64_t>();
  std::vector<int64_t> offset(B);  // each row's first index in out_ids
  int64_t t_old = 0, b_old = 0, t_new = 0, b_new = 0;
  for (int64_t i = 0; i < B; ++i) {
    offset[i] = t_new;
    const int64_t q = record[i];
    if (q < 0) {
      std::copy(old_ids + t_old, old_ids + t_old + c[i], id2 + t_new);
      std::copy(old_blocks + b_old, old_blocks + b_old + u[i], bl2 + b_new);
    } else {
      std::copy(e + q + 5, e + q + 5 + c2[i], id2 + t_new);
      const int64_t* from = e[q + 4] < 0 ? old_blocks + b_old : e + q + 5 + c2[i];
      std::copy(from, from + u2[i], bl2 + b_new);
    }
    t_old += c[i];
    b_old += u[i];
    t_new += c2[i];
    b_new += u2[i];
  }
  TORCH_CHECK(t_old == ids.size(0) && b_old == blocks.size(0), "ids, blocks: one segment a row");
  for (int64_t f = 0; f < F; ++f) {  // a reshaped row was read whole, its fed tokens in it
    const int64_t i = e[1 + 3 * f], at = e[2 + 3 * f];
    TORCH_CHECK(i >= 0 && i < B && at >= 0, "fed: row ", i);
    if (record[i] < 0) {
      TORCH_CHECK(at < c[i], "fed: row ", i, " has no input ", at);
      id2[offset[i] + at] = e[3 + 3 * f];
    }
  }
  return {out_starts, out_counts, out_wanted, out_used, out_ids, out_blocks};
}

// q when every row feeds q <= decode_max_query tokens after cached ones and wants a logits row for each; else 0.
int64_t graph_query_len(const at::Tensor& starts, const at::Tensor& counts, const at::Tensor& wanted,
                        int64_t decode_max_query) {
  const int64_t B = starts.size(0);
  if (B == 0) return 0;
  const auto* s = starts.data_ptr<int64_t>();
  const auto* c = counts.data_ptr<int64_t>();
  const auto* w = wanted.data_ptr<int64_t>();
  const int64_t q = c[0];
  if (q > decode_max_query) return 0;
  for (int64_t i = 0; i < B; ++i) {
    if (c[i] != q || s[i] == 0 || w[i] != q) return 0;
  }
  return q;
}

// plan_patch, then step_inputs and the graph's q of the patched plan (see the header).
std::tuple<std::vector<at::Tensor>, int64_t> plan_patch_step(
    const at::Tensor& starts, const at::Tensor& counts, const at::Tensor& wanted, const at::Tensor& used,
    const at::Tensor& ids, const at::Tensor& blocks, const at::Tensor& edits, int64_t block_size,
    int64_t decode_max_query) {
  std::vector<at::Tensor> out = plan_patch(starts, counts, wanted, used, ids, blocks, edits);
  std::vector<at::Tensor> step = step_inputs(out[0], out[1], out[2], out[3], out[5], block_size, decode_max_query);
  out.insert(out.end(), step.begin(), step.end());
  return {out, graph_query_len(out[0], out[1], out[2], decode_max_query)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("step_inputs(Tensor starts, Tensor counts, Tensor wanted, Tensor used, Tensor blocks, int block_size, int decode_max_query) -> Tensor[]");
  m.def("plan_patch(Tensor starts, Tensor counts, Tensor wanted, Tensor used, Tensor ids, Tensor blocks, Tensor edits) -> Tensor[]");
  m.def("plan_patch_step(Tensor starts, Tensor counts, Tensor wanted, Tensor used, Tensor ids, Tensor blocks, Tensor edits, int block_size, int decode_max_query) -> (Tensor[], int)");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("step_inputs", &step_inputs);
  m.impl("plan_patch", &plan_patch);
  m.impl("plan_patch_step", &plan_patch_step);
}
