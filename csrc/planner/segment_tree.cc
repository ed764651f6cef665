#include "planner/segment_tree.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "util/int_math.h"

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
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int64_t a, int64_t b) { return lo_[a] != lo_[b] ? lo_[a] < lo_[b] : start_[a] < start_[b]; });
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
    for (int64_t v = 0; v < t->num_nodes(); ++v) depth[v] = t->node_parent[v] < 0 ? 1 : depth[t->node_parent[v]] + 1;
    t->path_ptr.assign(t->num_rows() + 1, 0);
    for (int64_t i = 0; i < t->num_rows(); ++i)
      t->path_ptr[i + 1] = t->path_ptr[i] + (t->end_node[i] < 0 ? 0 : depth[t->end_node[i]]);
    t->path_nodes.resize(t->path_ptr.back());
    for (int64_t i = 0; i < t->num_rows(); ++i)
      for (int64_t v = t->end_node[i], k = t->path_ptr[i + 1]; v >= 0; v = t->node_parent[v]) t->path_nodes[--k] = v;
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
  if (num_rows < 0)
    return Status::Error(Code::kInvalidArgument, "num_rows must be >= 0, got " + std::to_string(num_rows));
  for (int64_t i = 0; i < num_rows; ++i)
    if (lengths[i] < 0)
      return Status::Error(Code::kInvalidArgument,
                           "lengths[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(lengths[i]));
  return Status::Ok();
}

// Sorts the rows into trie order (lexicographic by their column keys, stable) and gives each
// sorted row the tokens it shares with the previous one, by MSD radix: a group of rows that
// agree so far skips the columns where all agree (row by row, reading each row's cells in
// memory order) and splits at the first where they differ. The cost is the cells read before
// the groups part (no log factor on long shared prefixes).
// `Keys` provides: columns(); key(row, col) (comparable int64); terminal(key) (rows holding
// this key hold nothing after it: equal rows); shared(col, key_a, key_b) (tokens shared by
// rows first differing at col with these keys, key_a < key_b); run_end(a, b, col, limit) (the
// first column in [col, limit) where row a's key is terminal or row b's differs, else limit).
template <typename Keys>
void trie_order(const Keys& keys, const int64_t* lengths, int64_t num_rows, std::vector<int64_t>* order,
                std::vector<int64_t>* lcp) {
  order->resize(num_rows);
  std::iota(order->begin(), order->end(), 0);
  lcp->assign(num_rows, 0);
  auto equal_rows = [&](int64_t b, int64_t e) {
    for (int64_t i = b + 1; i < e; ++i) (*lcp)[i] = lengths[(*order)[i]];
  };
  struct Group {
    int64_t begin, end, col;
  };
  std::vector<Group> stack = {{0, num_rows, 0}};
  std::vector<std::pair<int64_t, int64_t>> split;  // (key, row) of the group being split
  while (!stack.empty()) {
    Group g = stack.back();
    stack.pop_back();
    if (g.end - g.begin < 2) continue;
    int64_t* rows = order->data() + g.begin;
    int64_t size = g.end - g.begin, col = keys.columns();
    for (int64_t i = 1; i < size; ++i) col = keys.run_end(rows[0], rows[i], g.col, col);
    if (col == keys.columns()) {
      equal_rows(g.begin, g.end);
      continue;
    }
    // At col the rows differ, or all hold the same terminal key (one run, equal rows). A
    // group's rows are in increasing id order, so sorting by (key, row) is the stable sort.
    split.resize(size);
    for (int64_t i = 0; i < size; ++i) split[i] = {keys.key(rows[i], col), rows[i]};
    // Often sorted already: blocks are handed out in fork order.
    if (!std::is_sorted(split.begin(), split.end())) std::sort(split.begin(), split.end());
    for (int64_t i = 0; i < size; ++i) rows[i] = split[i].second;
    for (int64_t run = 0, i = 1; i <= size; ++i) {
      if (i < size && split[i].first == split[run].first) continue;
      if (i < size) (*lcp)[g.begin + i] = keys.shared(col, split[i - 1].first, split[i].first);
      if (keys.terminal(split[run].first))
        equal_rows(g.begin + run, g.begin + i);
      else
        stack.push_back({g.begin + run, g.begin + i, col + 1});
      run = i;
    }
  }
}

// Keys given per breakpoint (-1 at and beyond a row's length).
struct BreakKeys {
  const int64_t* keys;
  const int64_t* breaks;
  int64_t num_breaks;
  int64_t columns() const { return num_breaks; }
  int64_t key(int64_t row, int64_t col) const { return keys[row * num_breaks + col]; }
  static bool terminal(int64_t key) { return key == -1; }
  int64_t shared(int64_t col, int64_t, int64_t) const { return breaks[col]; }
  int64_t run_end(int64_t a, int64_t b, int64_t col, int64_t limit) const {
    const int64_t *x = keys + a * num_breaks, *y = keys + b * num_breaks;
    while (col < limit && x[col] == y[col] && !terminal(x[col])) ++col;
    return col;
  }
};

// The first index in [begin, end) where x and y differ, else end. Runs of equal blocks are
// long (a shared prompt): memcmp, vectorised by libc, skips them a chunk at a time.
template <typename Entry>
int64_t first_difference(const Entry* x, const Entry* y, int64_t begin, int64_t end) {
  constexpr int64_t kChunk = 64;
  for (; begin < end; begin += kChunk) {
    int64_t stop = std::min(begin + kChunk, end);
    if (std::memcmp(x + begin, y + begin, (stop - begin) * sizeof(Entry)) != 0)
      return std::mismatch(x + begin, x + stop, y + begin).first - x;
  }
  return end;
}

// Keys of block-table columns: (block, tokens of the row in it), -1 once the row has ended.
// Rows with the same block share its tokens up to the shorter row's end. `Entry`: the
// tables' integer type; blocks[row] points at the row's table, full[row] counts its full
// blocks.
template <typename Entry>
struct TableKeys {
  std::vector<const Entry*> blocks;
  std::vector<int64_t> full;
  const int64_t* lengths;
  int64_t block_size, max_columns;
  int64_t columns() const { return max_columns; }
  int64_t key(int64_t row, int64_t col) const {
    int64_t tokens = std::min(block_size, lengths[row] - col * block_size);
    return tokens <= 0 ? -1 : int64_t(blocks[row][col]) * (block_size + 1) + tokens;
  }
  bool terminal(int64_t key) const { return key == -1 || key % (block_size + 1) < block_size; }
  int64_t shared(int64_t col, int64_t a, int64_t b) const {
    bool same_block = a >= 0 && a / (block_size + 1) == b / (block_size + 1);
    return col * block_size + (same_block ? a % (block_size + 1) : 0);
  }
  // Only full blocks are not terminal, so the run is the columns both rows fill, up to the
  // first different block. A group reaches col only through full blocks: col <= full.
  int64_t run_end(int64_t a, int64_t b, int64_t col, int64_t limit) const {
    return first_difference(blocks[a], blocks[b], col, std::min({limit, full[a], full[b]}));
  }
};

// Row i's table in int64 tables read through `rows` (nullptr: row i itself).
const int64_t* mirror_row(const int64_t* tables, const int64_t* rows, int64_t stride, int64_t i) {
  return tables + (rows ? rows[i] : i) * stride;
}

// The tree of block-table rows; row_table(i) points at row i's table.
template <typename Entry, typename RowTable>
Status tree_from_tables(int64_t num_rows, const int64_t* lengths, RowTable row_table, int64_t block_size,
                        SegmentTree* out) {
  Status st = check_lengths(num_rows, lengths);
  if (!st.ok()) return st;
  if (block_size < 1) return Status::Error(Code::kInvalidArgument, "block_size must be >= 1");
  TableKeys<Entry> keys{std::vector<const Entry*>(num_rows), std::vector<int64_t>(num_rows), lengths, block_size, 0};
  for (int64_t i = 0; i < num_rows; ++i) {
    keys.blocks[i] = row_table(i);
    keys.full[i] = lengths[i] / block_size;
    keys.max_columns = std::max(keys.max_columns, ceil_div(lengths[i], block_size));
  }
  SegmentTree tree;
  tree.lengths.assign(lengths, lengths + num_rows);
  std::vector<int64_t> order, lcp;
  trie_order(keys, lengths, num_rows, &order, &lcp);
  build_from_sorted(std::move(order), lcp, &tree);
  *out = std::move(tree);
  return Status::Ok();
}

}  // namespace

// The trie reads keys[row][c] as the row's tokens from breaks[c] on: the breaks must be
// increasing from 0 and hold every length, and a row's keys -1 exactly from its length on.
Status check_breaks(int64_t num_rows, const int64_t* lengths, int64_t num_breaks, const int64_t* breaks,
                    const int64_t* keys) {
  auto invalid = [](const std::string& m) { return Status::Error(Code::kInvalidArgument, m); };
  if (num_breaks < 0) return invalid("num_breaks must be >= 0, got " + std::to_string(num_breaks));
  if (num_rows && (!num_breaks || breaks[0] != 0)) return invalid("breaks must start at 0");
  for (int64_t c = 1; c < num_breaks; ++c)
    if (breaks[c] <= breaks[c - 1])
      return invalid("breaks must be strictly increasing, got " + std::to_string(breaks[c - 1]) + " then " +
                     std::to_string(breaks[c]));
  for (int64_t i = 0; i < num_rows; ++i) {
    if (!std::binary_search(breaks, breaks + num_breaks, lengths[i]))
      return invalid("breaks must hold every row length; row " + std::to_string(i) + "'s " +
                     std::to_string(lengths[i]) + " is missing");
    for (int64_t c = 0; c < num_breaks; ++c)
      if ((keys[i * num_breaks + c] == -1) != (breaks[c] >= lengths[i]))
        return invalid("keys[" + std::to_string(i) + "][" + std::to_string(c) +
                       "] must be -1 exactly at and beyond the row's length");
  }
  return Status::Ok();
}

Status build_segment_tree(int64_t num_rows, const int64_t* lengths, int64_t num_breaks, const int64_t* breaks,
                          const int64_t* keys, SegmentTree* out) {
  Status st = check_lengths(num_rows, lengths);
  if (st.ok()) st = check_breaks(num_rows, lengths, num_breaks, breaks, keys);
  if (!st.ok()) return st;
  SegmentTree tree;
  tree.lengths.assign(lengths, lengths + num_rows);
  std::vector<int64_t> order, lcp;
  trie_order(BreakKeys{keys, breaks, num_breaks}, lengths, num_rows, &order, &lcp);
  build_from_sorted(std::move(order), lcp, &tree);
  *out = std::move(tree);
  return Status::Ok();
}

Status segment_tree_from_tables(int64_t num_rows, const int64_t* lengths, const int32_t* tables, int64_t stride,
                                int64_t block_size, SegmentTree* out) {
  return tree_from_tables<int32_t>(num_rows, lengths, [&](int64_t i) { return tables + i * stride; }, block_size, out);
}

Status segment_tree_from_tables(int64_t num_rows, const int64_t* lengths, const int64_t* tables, const int64_t* rows,
                                int64_t stride, int64_t block_size, SegmentTree* out) {
  return tree_from_tables<int64_t>(
      num_rows, lengths, [&](int64_t i) { return mirror_row(tables, rows, stride, i); }, block_size, out);
}

bool tree_reads_block(const SegmentTree& tree, const int64_t* tables, const int64_t* rows, int64_t stride,
                      int64_t block_size, int64_t block) {
  for (int64_t v = 0; v < tree.num_nodes(); ++v) {
    const int64_t* first = mirror_row(tables, rows, stride, tree.order[tree.node_lo[v]]);
    const int64_t* last = first + ceil_div(tree.node_end[v], block_size);  // node_end >= 1
    if (std::find(first + tree.node_start[v] / block_size, last, block) != last) return true;
  }
  return false;
}

namespace {

Status broken(const std::string& what) {
  return Status::Error(Code::kInvalidArgument, "invalid segment tree: " + what);
}

std::string at(const char* array, int64_t i) { return std::string(array) + "[" + std::to_string(i) + "]"; }

Status check_nodes(const SegmentTree& t) {
  int64_t rows = t.num_rows(), nodes = t.num_nodes();
  for (int64_t v = 0; v < nodes; ++v) {
    int64_t parent = t.node_parent[v];
    if (t.node_start[v] < 0 || t.node_end[v] < t.node_start[v])
      return broken(at("node_start", v) + ".." + at("node_end", v) + " is not a token range");
    if (t.node_lo[v] < 0 || t.node_hi[v] < t.node_lo[v] || t.node_hi[v] > rows)
      return broken(at("node_lo", v) + ".." + at("node_hi", v) + " is not a range of the " + std::to_string(rows) +
                    " rows");
    if (parent < -1 || parent >= v) return broken(at("node_parent", v) + " must be -1 or an earlier node (pre-order)");
    if (parent < 0) {
      if (t.node_start[v] != 0) return broken("root " + std::to_string(v) + " must start at token 0");
      continue;
    }
    if (t.node_end[parent] != t.node_start[v])
      return broken("node " + std::to_string(v) + " starts at " + std::to_string(t.node_start[v]) +
                    ", its parent ends at " + std::to_string(t.node_end[parent]));
    if (t.node_lo[v] < t.node_lo[parent] || t.node_hi[v] > t.node_hi[parent])
      return broken("node " + std::to_string(v) + "'s rows are not within its parent's");
  }
  return Status::Ok();
}

Status check_rows(const SegmentTree& t) {
  int64_t rows = t.num_rows(), nodes = t.num_nodes();
  std::vector<int64_t> position(size_t(rows), -1);
  for (int64_t k = 0; k < rows; ++k) {
    int64_t row = t.order[k];
    if (row < 0 || row >= rows || position[row] >= 0) return broken("order is not a permutation of the rows");
    position[row] = k;
  }
  if (t.path_ptr[0] != 0 || t.path_ptr[rows] != int64_t(t.path_nodes.size()))
    return broken("path_ptr must run from 0 to len(path_nodes)");
  for (int64_t i = 0; i < rows; ++i) {
    int64_t first = t.path_ptr[i], last = t.path_ptr[i + 1], end = t.end_node[i];
    if (t.lengths[i] < 0) return broken(at("lengths", i) + " is negative");
    if (last < first) return broken("path_ptr decreases at row " + std::to_string(i));
    if (end < -1 || end >= nodes) return broken(at("end_node", i) + " is not a node");
    if ((end < 0) != (last == first) || (end < 0 && t.lengths[i] != 0))
      return broken("row " + std::to_string(i) + " has a path exactly when it has tokens");
    for (int64_t k = first; k < last; ++k) {
      int64_t v = t.path_nodes[k];
      if (v < 0 || v >= nodes) return broken(at("path_nodes", k) + " is not a node");
      if (t.node_parent[v] != (k == first ? -1 : t.path_nodes[k - 1]))
        return broken("row " + std::to_string(i) + "'s path is not a chain from a root");
      if (position[i] < t.node_lo[v] || position[i] >= t.node_hi[v])
        return broken("row " + std::to_string(i) + " is on node " + std::to_string(v) + "'s path but not in its rows");
    }
    if (end >= 0 && (t.path_nodes[last - 1] != end || t.node_end[end] != t.lengths[i]))
      return broken("row " + std::to_string(i) + "'s path must end at the node ending at its length");
  }
  return Status::Ok();
}

}  // namespace

Status check_segment_tree(const SegmentTree& t) {
  size_t rows = t.lengths.size(), nodes = t.node_start.size();
  if (t.node_end.size() != nodes || t.node_parent.size() != nodes || t.node_lo.size() != nodes ||
      t.node_hi.size() != nodes)
    return broken("the node arrays must be of one length");
  if (t.order.size() != rows || t.end_node.size() != rows || t.path_ptr.size() != rows + 1)
    return broken("order and end_node must hold one entry per row, path_ptr one more");
  Status st = check_nodes(t);
  return st.ok() ? check_rows(t) : st;
}

}  // namespace flash_reasoning
