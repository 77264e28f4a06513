// The bounded-depth suffix trie of tandem/spec_decode/suffix.py, in C++ (a pybind11 module).
//
// The same data structure as the Python `SuffixTree`, operation for operation: node `n` has count_[n] and
// children_[n] (token -> child code; a code >= 0 is a node id, a code < 0 is ~leaf); a leaf stands for one path's
// unique tail and reads its tokens from the sequence itself. Children keep insertion order (as a Python dict does),
// so `speculate` breaks ties between equally frequent continuations exactly as the Python tree does: the same
// drafts from either (tests/spec_decode/test_suffix.py checks both against each other).
//
// Why: at 256 concurrent requests, suffix decoding appends ~370 tokens a step to the requests' trees at ~4.4 us a
// token in Python (1.6 ms of the host's step, more at admission, when whole prompts go in), on the host thread
// that must finish its step's work before the device's forward ends.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using Token = int64_t;
using Code = int32_t;  // >= 0: a node id; < 0: ~leaf id

// One node's children in insertion order; an index by token once there are many (the root has thousands).
class Children {
 public:
  static constexpr size_t kIndexFrom = 16;

  const Code* find(Token token) const { return const_cast<Children*>(this)->find(token); }

  Code* find(Token token) {
    if (index_) {
      auto it = index_->find(token);
      return it == index_->end() ? nullptr : &items_[it->second].second;
    }
    for (auto& item : items_)
      if (item.first == token) return &item.second;
    return nullptr;
  }

  // Python's `children[token] = code`: replaced in place when present, else appended.
  void set(Token token, Code code) {
    if (Code* at = find(token)) {
      *at = code;
      return;
    }
    items_.emplace_back(token, code);
    if (index_) {
      (*index_)[token] = static_cast<uint32_t>(items_.size() - 1);
    } else if (items_.size() > kIndexFrom) {
      reindex();
    }
  }

  void erase(Token token) {
    for (size_t i = 0; i < items_.size(); ++i) {
      if (items_[i].first == token) {
        items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
        if (index_) reindex();
        return;
      }
    }
    throw py::key_error(std::to_string(token));
  }

  void clear() {
    items_.clear();
    index_.reset();
  }

  const std::vector<std::pair<Token, Code>>& items() const { return items_; }
  bool empty() const { return items_.empty(); }

 private:
  void reindex() {
    if (items_.size() <= kIndexFrom) {
      index_.reset();
      return;
    }
    if (!index_) index_ = std::make_unique<std::unordered_map<Token, uint32_t>>();
    index_->clear();
    for (size_t i = 0; i < items_.size(); ++i) (*index_)[items_[i].first] = static_cast<uint32_t>(i);
  }

  std::vector<std::pair<Token, Code>> items_;
  std::unique_ptr<std::unordered_map<Token, uint32_t>> index_;
};

// A growing sequence's paths that end at explicit nodes: start -> node, in insertion order (a Python dict).
using Growing = std::vector<std::pair<int64_t, Code>>;

Growing::iterator find_start(Growing& growing, int64_t start) {
  return std::find_if(growing.begin(), growing.end(), [start](const auto& p) { return p.first == start; });
}

void set_start(Growing& growing, int64_t start, Code node) {
  auto it = find_start(growing, start);
  if (it != growing.end()) {
    it->second = node;
  } else {
    growing.emplace_back(start, node);
  }
}

void pop_start(Growing& growing, int64_t start) {
  auto it = find_start(growing, start);
  if (it != growing.end()) growing.erase(it);
}

// (tokens, score): a speculated continuation and the sum over its tokens of their cumulative probability.
using Draft = std::tuple<std::vector<Token>, double>;
// (tokens, score, match length)
using Scored = std::tuple<std::vector<Token>, double, int64_t>;

class SuffixTree {
 public:
  explicit SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 1) throw py::value_error("max_depth must be >= 1, got " + std::to_string(max_depth));
    count_.push_back(0);  // node 0 = the root
    children_.emplace_back();
  }

  int64_t max_depth() const { return max_depth_; }

  // ---- updates -------------------------------------------------------------------------------------------------
  void extend(int64_t seq_id, const std::vector<Token>& tokens) {
    auto found = seqs_.find(seq_id);
    if (found == seqs_.end()) {
      found = seqs_.emplace(seq_id, std::vector<Token>{}).first;
      growing_.emplace(seq_id, Growing{});
    }
    auto g = growing_.find(seq_id);
    if (g == growing_.end())
      throw py::value_error("sequence " + std::to_string(seq_id) + " was finished; it cannot grow");
    std::vector<Token>& seq = found->second;  // (unordered_map: references stay valid as it grows)
    for (Token token : tokens) append(seq_id, seq, g->second, token);
  }

  void finish(int64_t seq_id) { growing_.erase(seq_id); }

  void remove(int64_t seq_id) {
    auto found = seqs_.find(seq_id);
    if (found == seqs_.end()) throw py::key_error(std::to_string(seq_id));
    const std::vector<Token>& seq = found->second;
    growing_.erase(seq_id);
    const int64_t n = static_cast<int64_t>(seq.size());
    for (int64_t start = 0; start < n; ++start) {
      Code node = 0;
      for (int64_t pos = start; pos < std::min(start + max_depth_, n); ++pos) {
        const Token token = seq[pos];
        Code* at = children_[node].find(token);
        if (at == nullptr) throw std::logic_error("suffix tree: a path of the removed sequence is missing");
        const Code child = *at;
        if (child < 0) {
          children_[node].erase(token);
          free_subtree(child);
          break;
        }
        if (--count_[child] == 0) {
          children_[node].erase(token);  // the rest of the path hangs below and goes with it
          free_subtree(child);
          break;
        }
        node = child;
      }
    }
    seqs_.erase(found);  // after the walk: the leaves freed above read its length
  }

  // ---- queries -------------------------------------------------------------------------------------------------
  std::vector<Token> sequence(int64_t seq_id) const { return seq_of(seq_id); }

  int64_t length(int64_t seq_id) const {
    auto it = seqs_.find(seq_id);
    return it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.size());
  }

  // The last `n` tokens of the sequence (all of them when shorter).
  std::vector<Token> tail(int64_t seq_id, int64_t n) const {
    const std::vector<Token>& seq = seq_of(seq_id);
    const size_t from = seq.size() > static_cast<size_t>(std::max<int64_t>(0, n)) ? seq.size() - n : 0;
    return std::vector<Token>(seq.begin() + static_cast<std::ptrdiff_t>(from), seq.end());
  }

  bool contains(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }

  int64_t num_points() const {
    return static_cast<int64_t>(count_.size() - free_nodes_.size() + leaf_seq_.size() - free_leaves_.size());
  }

  // Node and leaf ids ever allocated (freed ones are reused: this stays near the peak of `num_points`).
  int64_t capacity() const { return static_cast<int64_t>(count_.size() + leaf_seq_.size()); }

  int64_t node_count(int64_t node) const { return count_.at(static_cast<size_t>(node)); }

  // The point for string `tokens`: (node, leaf, next_pos) with node or leaf -1, or none.
  std::optional<std::tuple<int64_t, int64_t, int64_t>> walk(const std::vector<Token>& tokens) const {
    return walk_range(tokens.data(), tokens.size());
  }

  int64_t longest_match(const std::vector<Token>& context, int64_t max_length) const {
    const int64_t n = static_cast<int64_t>(context.size());
    int64_t lo = 0, hi = std::min({max_length, n, max_depth_});
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (!walk_range(context.data() + (n - mid), static_cast<size_t>(mid))) {
        hi = mid - 1;
      } else {
        lo = mid;
      }
    }
    return lo;
  }

  Draft speculate(int64_t node, int64_t leaf, int64_t next_pos, int64_t max_tokens, double min_token_prob) const {
    std::vector<Token> out;
    double score = 0.0, prob = 1.0;
    while (static_cast<int64_t>(out.size()) < max_tokens) {
      if (leaf >= 0) {  // a unique tail: every next token has probability 1
        const std::vector<Token>& seq = seq_of(leaf_seq_[leaf]);
        const int64_t stop = std::min(leaf_end(leaf), next_pos + max_tokens - static_cast<int64_t>(out.size()));
        const int64_t taken = std::max<int64_t>(0, stop - next_pos);
        if (taken > 0) out.insert(out.end(), seq.begin() + next_pos, seq.begin() + next_pos + taken);
        score += prob * static_cast<double>(taken);
        break;
      }
      const Children& children = children_[node];
      if (children.empty()) break;
      Token best_token = -1;
      Code best_child = 0;
      int64_t best_count = 0, total = 0;
      for (const auto& [token, child] : children.items()) {
        const int64_t c = child >= 0 ? count_[child] : 1;
        total += c;
        if (c > best_count) {
          best_token = token;
          best_child = child;
          best_count = c;
        }
      }
      prob *= static_cast<double>(best_count) / static_cast<double>(total);
      if (prob < min_token_prob) break;
      out.push_back(best_token);
      score += prob;
      if (best_child < 0) {
        leaf = ~best_child;
        next_pos = leaf_pos_[leaf] + 1;
      } else {
        node = best_child;
      }
    }
    return {out, score};
  }

  // For a growing sequence: match length m -> node id of its suffix of length m, for suffixes occurring >= 2x.
  std::vector<std::pair<int64_t, int64_t>> growing_match(int64_t seq_id) const {
    std::vector<std::pair<int64_t, int64_t>> out;
    auto g = growing_.find(seq_id);
    if (g == growing_.end()) return out;
    const int64_t n = length(seq_id);
    for (const auto& [start, node] : g->second) out.emplace_back(n - start, node);
    return out;
  }

  // Every stored string -> its count (the canonical content, independent of how it was built).
  py::dict counts() const {
    py::dict out;
    std::vector<std::pair<Code, std::vector<Token>>> stack{{0, {}}};
    while (!stack.empty()) {
      auto [node, prefix] = std::move(stack.back());
      stack.pop_back();
      for (const auto& [token, child] : children_[node].items()) {
        std::vector<Token> string = prefix;
        string.push_back(token);
        if (child < 0) {
          const int64_t leaf = ~child;
          out[py::tuple(py::cast(string))] = 1;
          const std::vector<Token>& seq = seq_of(leaf_seq_[leaf]);
          for (int64_t p = leaf_pos_[leaf] + 1; p < leaf_end(leaf); ++p) {
            string.push_back(seq[p]);
            out[py::tuple(py::cast(string))] = 1;
          }
        } else {
          out[py::tuple(py::cast(string))] = count_[child];
          stack.emplace_back(child, std::move(string));
        }
      }
    }
    return out;
  }

  // ---- drafts (suffix.py `SuffixProposer._draft`, one tree's part) ----------------------------------------------
  // The best draft from the growing sequence's own matches: the longest match m, and min(m, D - max_drafts).
  Scored best_own(int64_t seq_id, int64_t max_drafts, double spec_factor, double min_token_prob) const {
    Scored best{{}, 0.0, 0};
    auto g = growing_.find(seq_id);
    if (g == growing_.end() || g->second.empty()) return best;
    const int64_t n = length(seq_id);
    int64_t longest = 0;
    for (const auto& entry : g->second) longest = std::max(longest, n - entry.first);
    for (int64_t m : match_lengths(longest, max_drafts)) {
      for (const auto& [start, node] : g->second) {
        if (n - start == m) {
          better(best, speculate(node, -1, 0, max_tokens(m, max_drafts, spec_factor), min_token_prob), m);
          break;
        }
      }
    }
    return best;
  }

  // The best draft at the longest match of `context`'s tail (and at min(m, D - max_drafts)).
  Scored best_walked(const std::vector<Token>& context, int64_t max_drafts, double spec_factor,
                     double min_token_prob) const {
    Scored best{{}, 0.0, 0};
    const int64_t longest = longest_match(context, max_depth_);
    const int64_t n = static_cast<int64_t>(context.size());
    for (int64_t m : match_lengths(longest, max_drafts)) {
      auto cursor = walk_range(context.data() + (n - m), static_cast<size_t>(m));
      if (!cursor) continue;
      auto [node, leaf, next_pos] = *cursor;
      better(best, speculate(node, leaf, next_pos, max_tokens(m, max_drafts, spec_factor), min_token_prob), m);
    }
    return best;
  }

 private:
  const std::vector<Token>& seq_of(int64_t seq_id) const {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) throw py::key_error(std::to_string(seq_id));
    return it->second;
  }

  // sorted({longest, min(longest, D - max_drafts)}, reverse=True), those >= 1
  std::vector<int64_t> match_lengths(int64_t longest, int64_t max_drafts) const {
    const int64_t shorter = std::min(longest, max_depth_ - max_drafts);
    std::vector<int64_t> out;
    if (longest >= 1) out.push_back(longest);
    if (shorter != longest && shorter >= 1) out.push_back(shorter);
    return out;
  }

  static int64_t max_tokens(int64_t match_length, int64_t max_drafts, double spec_factor) {
    return std::min<int64_t>(max_drafts, static_cast<int64_t>(spec_factor * static_cast<double>(match_length) + 1e-9));
  }

  static void better(Scored& best, Draft draft, int64_t match_length) {
    if (std::get<1>(draft) > std::get<1>(best))
      best = Scored{std::move(std::get<0>(draft)), std::get<1>(draft), match_length};
  }

  std::optional<std::tuple<int64_t, int64_t, int64_t>> walk_range(const Token* tokens, size_t len) const {
    Code node = 0;
    for (size_t i = 0; i < len; ++i) {
      const Code* at = children_[node].find(tokens[i]);
      if (at == nullptr) return std::nullopt;
      const Code child = *at;
      if (child < 0) {
        const int64_t leaf = ~child;
        const int64_t pos = leaf_pos_[leaf];
        const int64_t stop = pos + static_cast<int64_t>(len - i);
        if (stop > leaf_end(leaf)) return std::nullopt;
        const std::vector<Token>& seq = seq_of(leaf_seq_[leaf]);
        if (!std::equal(tokens + i, tokens + len, seq.begin() + pos)) return std::nullopt;
        return std::make_tuple(int64_t{-1}, leaf, stop);
      }
      node = child;
    }
    return std::make_tuple(static_cast<int64_t>(node), int64_t{-1}, int64_t{0});
  }

  Code new_node(int64_t count) {
    if (!free_nodes_.empty()) {
      const Code node = free_nodes_.back();
      free_nodes_.pop_back();
      count_[node] = count;
      return node;
    }
    count_.push_back(count);
    children_.emplace_back();
    return static_cast<Code>(count_.size() - 1);
  }

  Code new_leaf(int64_t seq_id, int64_t start, int64_t pos) {  // a leaf's child code (< 0)
    int64_t leaf;
    if (!free_leaves_.empty()) {
      leaf = free_leaves_.back();
      free_leaves_.pop_back();
      leaf_seq_[leaf] = seq_id;
      leaf_start_[leaf] = start;
      leaf_pos_[leaf] = pos;
    } else {
      leaf = static_cast<int64_t>(leaf_seq_.size());
      leaf_seq_.push_back(seq_id);
      leaf_start_.push_back(start);
      leaf_pos_.push_back(pos);
    }
    return static_cast<Code>(~leaf);
  }

  void free_subtree(Code code) {  // the ids under child code `code` (already unlinked) to the free lists
    std::vector<Code> stack{code};
    while (!stack.empty()) {
      code = stack.back();
      stack.pop_back();
      if (code < 0) {
        free_leaves_.push_back(~code);
        continue;
      }
      for (const auto& item : children_[code].items()) stack.push_back(item.second);
      children_[code].clear();
      free_nodes_.push_back(code);
    }
  }

  int64_t leaf_end(int64_t leaf) const {  // one past the last sequence index the leaf covers
    return std::min(leaf_start_[leaf] + max_depth_, static_cast<int64_t>(seq_of(leaf_seq_[leaf]).size()));
  }

  // seq += [token]: the paths ending at explicit nodes step to their `token` child, plus a new path.
  void append(int64_t seq_id, std::vector<Token>& seq, Growing& growing, Token token) {
    const int64_t pos = static_cast<int64_t>(seq.size());
    seq.push_back(token);  // paths ending inside leaves of this sequence grow with it, no work
    const int64_t complete = pos + 1 - max_depth_;  // paths starting at or before this reach depth D now
    Growing paths = growing;
    paths.emplace_back(pos, 0);
    for (const auto& [start, node] : paths) {
      Code* at = children_[node].find(token);
      if (at == nullptr) {
        const Code leaf = new_leaf(seq_id, start, pos);  // first occurrence: a unique tail
        children_[node].set(token, leaf);
        if (start != pos) pop_start(growing, start);
        continue;
      }
      Code child = *at;
      if (child < 0) child = split(node, token, ~child);
      ++count_[child];
      if (start <= complete) {
        pop_start(growing, start);
      } else {
        set_start(growing, start, child);
      }
    }
  }

  // Make the first point of `leaf` (under `parent` via `token`) an explicit node holding the leaf's count 1.
  Code split(Code parent, Token token, int64_t leaf) {
    const Code node = new_node(1);
    children_[parent].set(token, node);
    const int64_t pos = ++leaf_pos_[leaf];
    if (pos < leaf_end(leaf)) {
      children_[node].set(seq_of(leaf_seq_[leaf])[pos], static_cast<Code>(~leaf));
    } else {
      // the leaf's path ends at the new node; if it still grows it is tracked as ending at an explicit node
      free_leaves_.push_back(leaf);
      const int64_t start = leaf_start_[leaf];
      auto g = growing_.find(leaf_seq_[leaf]);
      if (g != growing_.end() && pos - start < max_depth_) set_start(g->second, start, node);
    }
    return node;
  }

  int64_t max_depth_;
  std::vector<int64_t> count_;
  std::vector<Children> children_;
  std::vector<Code> free_nodes_;
  std::vector<int64_t> leaf_seq_, leaf_start_, leaf_pos_;
  std::vector<int64_t> free_leaves_;
  std::unordered_map<int64_t, std::vector<Token>> seqs_;
  std::unordered_map<int64_t, Growing> growing_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tandem's bounded-depth suffix trie (tandem/spec_decode/suffix.py), native";
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int64_t>(), py::arg("max_depth") = 64)
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def("extend", &SuffixTree::extend)
      .def("finish", &SuffixTree::finish)
      .def("remove", &SuffixTree::remove)
      .def("sequence", &SuffixTree::sequence)
      .def("length", &SuffixTree::length)
      .def("tail", &SuffixTree::tail)
      .def("__contains__", &SuffixTree::contains)
      .def_property_readonly("num_sequences", &SuffixTree::num_sequences)
      .def_property_readonly("num_points", &SuffixTree::num_points)
      .def_property_readonly("capacity", &SuffixTree::capacity)
      .def("node_count", &SuffixTree::node_count)
      .def("walk", &SuffixTree::walk)
      .def("longest_match", &SuffixTree::longest_match)
      .def("speculate", &SuffixTree::speculate)
      .def("growing_match", &SuffixTree::growing_match)
      .def("counts", &SuffixTree::counts)
      .def("best_own", &SuffixTree::best_own)
      .def("best_walked", &SuffixTree::best_walked);
}
