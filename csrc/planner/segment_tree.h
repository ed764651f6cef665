// The segment tree of a set of branches: maximal token ranges that the same branches read
// from the same physical KV slots, so each can be read once for all of them.
#pragma once

#include <cstdint>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

// Nodes are numbered in DFS pre-order (a parent before its children). Node v covers tokens
// [node_start[v], node_end[v]); its parent (-1 for a root: branches with no common prefix form
// a forest) ends where it starts. The rows below v are order[node_lo[v]:node_hi[v]]. Row i's
// path runs from a root to end_node[i] (-1 for an empty branch):
// path_nodes[path_ptr[i]:path_ptr[i + 1]].
struct SegmentTree {
  std::vector<int64_t> lengths;
  std::vector<int64_t> node_start, node_end, node_parent, node_lo, node_hi;
  std::vector<int64_t> order, end_node, path_ptr, path_nodes;

  int64_t num_rows() const { return int64_t(lengths.size()); }
  int64_t num_nodes() const { return int64_t(node_start.size()); }
  int64_t logical_tokens() const {  // the rows' lengths summed: what reading no prefix once costs
    int64_t total = 0;
    for (int64_t length : lengths) total += length;
    return total;
  }
  int64_t unique_tokens() const {  // the nodes' lengths summed: each shared token once
    int64_t total = 0;
    for (int64_t v = 0; v < num_nodes(); ++v) total += node_end[v] - node_start[v];
    return total;
  }
};

// kInvalidArgument naming the first broken invariant of `tree` (array sizes, pre-order parents
// that end where their children start, row ranges nested in their parents', `order` a
// permutation, each row's path from a root to the node ending at its length): the planner and
// the kernels index by these arrays, so a tree built elsewhere is checked before it is planned.
Status check_segment_tree(const SegmentTree& tree);

// The tree of `num_rows` rows whose token t is identified by keys[row * num_breaks + c] for
// breaks[c] <= t < breaks[c + 1] (-1 at and beyond the row's length). `breaks` is sorted,
// holds 0 and every row length, so two rows share exactly the tokens before the first break
// where their keys differ (a trie over the rows).
Status build_segment_tree(int64_t num_rows, const int64_t* lengths, int64_t num_breaks, const int64_t* breaks,
                          const int64_t* keys, SegmentTree* out);

// The tree read from paged block tables: rows listing the same block at the same column
// share those tokens, up to the shorter row's length. tables[row * stride + col].
Status segment_tree_from_tables(int64_t num_rows, const int64_t* lengths, const int32_t* tables, int64_t stride,
                                int64_t block_size, SegmentTree* out);

// The same with int64 entries, row i's table at tables + rows[i] * stride (rows: nullptr for
// row i at tables + i * stride): the Python allocator's table mirror, read in place.
Status segment_tree_from_tables(int64_t num_rows, const int64_t* lengths, const int64_t* tables, const int64_t* rows,
                                int64_t stride, int64_t block_size, SegmentTree* out);

// Whether the rows of `tree`, read from these tables (as above), hold tokens in `block`. The
// rows below a node share its blocks, so one row per node is read, not every row's table.
// The allocator asks it of its zero block: the tables alone tell sharing only when every
// token is written.
bool tree_reads_block(const SegmentTree& tree, const int64_t* tables, const int64_t* rows, int64_t stride,
                      int64_t block_size, int64_t block);

}  // namespace flash_reasoning
