#include "segment_tree.h"

#include <algorithm>
#include <numeric>

namespace flash_reasoning {
namespace {

// Builds the compacted trie from rows in sorted order and each one's LCP with the previous.
class TrieBuilder {
 public:
  // Adds sorted row i, sharing `shared` tokens with row i - 1; returns its end node.
  int64_t add_row(int64_t i, int64_t length, int64_t shared) {
    int64_t popped = -1;
    while (!stack_.empty() && end_[stack_.back()] > shared) {
      popped = stack_.back();
      stack_.pop_back();
      hi_[popped] = i;
    }
    int64_t top_end = stack_.empty() ? 0 : end_[stack_.back()];
    if (top_end < shared) {
      // Row i branches off inside `popped`: split it; its head is on row i's path.
      int64_t head = add_node(top_end, shared, lo_[popped]);
      start_[popped] = shared;
      parent_[popped] = head;
    }
    if (length > shared) add_node(shared, length, i);
    return stack_.empty() ? -1 : stack_.back();
  }

  // Renumbers the nodes in DFS pre-order and fills `out` (lengths and order already set).
  void finish(const std::vector<int64_t>& sorted_end_node, SegmentTree* out) {
    int64_t rows = out->num_rows();
    for (int64_t v : stack_) hi_[v] = rows;
    int64_t count = int64_t(start_.size());
    // An ancestor has a smaller lo, or the same lo and a smaller start.
    std::vector<int64_t> perm(count);
    std::iota(perm.begin(), perm.end(), 0);
    std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
      return lo_[a] != lo_[b] ? lo_[a] < lo_[b] : start_[a] < start_[b];
    });
    std::vector<int64_t> new_id(count);
    for (int64_t k = 0; k < count; ++k) new_id[perm[k]] = k;
    auto renamed = [&](int64_t v) { return v < 0 ? v : new_id[v]; };
    out->node_start.resize(count);
    out->node_end.resize(count);
    out->node_parent.resize(count);
    out->node_lo.resize(count);
    out->node_hi.resize(count);
    for (int64_t k = 0; k < count; ++k) {
      int64_t v = perm[k];
      out->node_start[k] = start_[v];
      out->node_end[k] = end_[v];
      out->node_parent[k] = renamed(parent_[v]);
      out->node_lo[k] = lo_[v];
      out->node_hi[k] = hi_[v];
    }
    out->end_node.assign(rows, -1);
    for (int64_t i = 0; i < rows; ++i) out->end_node[out->order[i]] = renamed(sorted_end_node[i]);
    fill_paths(out);
  }

 private:
  int64_t add_node(int64_t start, int64_t end, int64_t lo) {
    start_.push_back(start);
    end_.push_back(end);
    parent_.push_back(stack_.empty() ? -1 : stack_.back());
    lo_.push_back(lo);
    hi_.push_back(-1);
    stack_.push_back(int64_t(start_.size()) - 1);
    return stack_.back();
  }

  // Each row's root-to-end path; parents precede children, so depths come in one pass.
  static void fill_paths(SegmentTree* t) {
    std::vector<int64_t> depth(t->num_nodes());
    for (int64_t v = 0; v < t->num_nodes(); ++v)
      depth[v] = t->node_parent[v] < 0 ? 1 : depth[t->node_parent[v]] + 1;
    t->path_ptr.assign(t->num_rows() + 1, 0);
    for (int64_t i = 0; i < t->num_rows(); ++i)
      t->path_ptr[i + 1] = t->path_ptr[i] + (t->end_node[i] < 0 ? 0 : depth[t->end_node[i]]);
    t->path_nodes.resize(t->path_ptr.back());
    for (int64_t i = 0; i < t->num_rows(); ++i)
      for (int64_t v = t->end_node[i], k = t->path_ptr[i + 1]; v >= 0; v = t->node_parent[v])
        t->path_nodes[--k] = v;
  }

  std::vector<int64_t> start_, end_, parent_, lo_, hi_;
  std::vector<int64_t> stack_;  // the path of the previous row
};

// Fills the tree from rows sorted into trie order and each sorted row's LCP with the previous.
void build_from_sorted(std::vector<int64_t> order, const std::vector<int64_t>& lcp, SegmentTree* out) {
  TrieBuilder nodes;
  std::vector<int64_t> sorted_end(order.size());
  for (size_t i = 0; i < order.size(); ++i)
    sorted_end[i] = nodes.add_row(int64_t(i), out->lengths[order[i]], i ? lcp[i] : 0);
  out->order = std::move(order);
  nodes.finish(sorted_end, out);
}

Status check_lengths(int64_t num_rows, const int64_t* lengths) {
  if (num_rows < 0) return Status::Error(Code::kInvalidArgument, "num_rows must be >= 0, got " + std::to_string(num_rows));
  for (int64_t i = 0; i < num_rows; ++i)
    if (lengths[i] < 0)
      return Status::Error(Code::kInvalidArgument, "lengths[" + std::to_string(i) + "] must be >= 0, got " +
                                                       std::to_string(lengths[i]));
  return Status::Ok();
}

// Tokens of a row in table column j (0 when the row ends before it).
int64_t tokens_in_column(int64_t length, int64_t j, int64_t block_size) {
  return std::max<int64_t>(0, std::min(block_size, length - j * block_size));
}

// Compares two rows' per-token keys (block id while covered, then -1) from column 0;
// returns <0, 0, >0 and the tokens they share.
int compare_tables(const int32_t* a, int64_t len_a, const int32_t* b, int64_t len_b, int64_t block_size,
                   int64_t* shared) {
  for (int64_t j = 0;; ++j) {
    int64_t ea = tokens_in_column(len_a, j, block_size), eb = tokens_in_column(len_b, j, block_size);
    *shared = j * block_size;
    if (ea == 0 || eb == 0) {
      if (ea == eb) *shared = len_a;  // both ended: identical rows
      return int(ea != 0) - int(eb != 0);
    }
    if (a[j] != b[j]) return a[j] < b[j] ? -1 : 1;
    if (ea != eb) {
      *shared += std::min(ea, eb);
      return ea < eb ? -1 : 1;  // the shorter row reads -1 first
    }
  }
}

}  // namespace

Status build_segment_tree(int64_t num_rows, const int64_t* lengths, int64_t num_breaks, const int64_t* breaks,
                          const int64_t* keys, SegmentTree* out) {
  Status st = check_lengths(num_rows, lengths);
  if (!st.ok()) return st;
  SegmentTree tree;
  tree.lengths.assign(lengths, lengths + num_rows);
  auto row = [&](int64_t i) { return keys + i * num_breaks; };
  std::vector<int64_t> order(num_rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(row(a), row(a) + num_breaks, row(b), row(b) + num_breaks);
  });
  std::vector<int64_t> lcp(num_rows, 0);
  for (int64_t i = 1; i < num_rows; ++i) {
    const int64_t *prev = row(order[i - 1]), *cur = row(order[i]);
    int64_t c = std::mismatch(cur, cur + num_breaks, prev).first - cur;
    // Identical key rows have identical lengths (lengths are breakpoints): all is shared.
    lcp[i] = c < num_breaks ? breaks[c] : lengths[order[i]];
  }
  build_from_sorted(std::move(order), lcp, &tree);
  *out = std::move(tree);
  return Status::Ok();
}

Status segment_tree_from_tables(int64_t num_rows, const int64_t* lengths, const int32_t* tables, int64_t stride,
                                int64_t block_size, SegmentTree* out) {
  Status st = check_lengths(num_rows, lengths);
  if (!st.ok()) return st;
  if (block_size < 1) return Status::Error(Code::kInvalidArgument, "block_size must be >= 1");
  SegmentTree tree;
  tree.lengths.assign(lengths, lengths + num_rows);
  auto compare = [&](int64_t a, int64_t b, int64_t* shared) {
    return compare_tables(tables + a * stride, lengths[a], tables + b * stride, lengths[b], block_size, shared);
  };
  std::vector<int64_t> order(num_rows);
  std::iota(order.begin(), order.end(), 0);
  int64_t ignored;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return compare(a, b, &ignored) < 0; });
  std::vector<int64_t> lcp(num_rows, 0);
  for (int64_t i = 1; i < num_rows; ++i) compare(order[i - 1], order[i], &lcp[i]);
  build_from_sorted(std::move(order), lcp, &tree);
  *out = std::move(tree);
  return Status::Ok();
}

}  // namespace flash_reasoning
