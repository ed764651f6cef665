"""Refcounted paged KV-cache allocator: branches of a reasoning tree share KV blocks.

See :class:`PhysicalKVAllocator` and ``docs/allocator.md``.
"""
from __future__ import annotations

import functools
import operator
import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from . import kv_cache, runtime
from .ops.checks import as_int, check_compiled, check_layer, check_q_lens
from .segment_tree import SegmentTree, query_rows

#: The reserved all-zero, read-only block backing every never-written position.
ZERO_BLOCK = 0
#: The longest branch any pool allows: the kernels hold lengths and positions in int32. An
#: allocator's own bound, :attr:`PhysicalKVAllocator.max_tokens`, is also at most what its pool
#: stores.
MAX_TOKENS = 2**31 - 1
#: The most blocks a pool may have: block tables are int32.
MAX_BLOCKS = 2**31 - 1
_INT64_MAX = 2**63 - 1


class PoolExhausted(RuntimeError):
    """Not enough free blocks; nothing was changed. ``needed`` and ``free`` are block counts."""

    def __init__(self, needed: int, free: int, what: str) -> None:
        super().__init__(f"KV pool exhausted: {what} needs {needed} free blocks, "
                         f"only {free} are free")
        self.needed, self.free = needed, free


class UnknownBranch(KeyError, ValueError):
    """A branch id that is not live (never allocated, freed or pruned). A KeyError (ids
    name branches) and a ValueError (a bad argument, like every other validation error)."""

    def __init__(self, branch_id: int) -> None:
        super().__init__(branch_id)
        self.branch_id = branch_id

    def __str__(self) -> str:  # KeyError would print only the repr of the id
        return f"branch_id {self.branch_id} is not a live branch (unknown, freed or pruned)"


def _locked(method):
    """Runs ``method`` holding the allocator's lock (see :class:`PhysicalKVAllocator`)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Branch:
    """A live view of one branch: ``length`` always reads the allocator's current length
    (and raises :class:`UnknownBranch` once the branch is freed). ``parent_id`` and
    ``fork_position`` record how it was created (``None``/0 for a root); the parent may have
    been freed since. It refers to its allocator weakly: the allocator keeps its branches,
    and a cycle would keep a dropped allocator's pools until the next garbage collection."""
    __slots__ = ("_allocator", "branch_id", "parent_id", "fork_position")

    def __init__(self, allocator: "PhysicalKVAllocator", branch_id: int,
                 parent_id: int | None, fork_position: int) -> None:
        self._allocator = weakref.ref(allocator)
        self.branch_id, self.parent_id, self.fork_position = branch_id, parent_id, fork_position

    @property
    def length(self) -> int:
        allocator = self._allocator()
        if allocator is None:
            raise UnknownBranch(self.branch_id)
        return allocator.length(self.branch_id)

    @property
    def alive(self) -> bool:
        allocator = self._allocator()
        return allocator is not None and allocator.is_alive(self.branch_id)

    def __repr__(self) -> str:
        length = self.length if self.alive else "freed"
        return (f"Branch(branch_id={self.branch_id}, length={length}, "
                f"parent_id={self.parent_id}, fork_position={self.fork_position})")


@dataclass(frozen=True)
class DecodeStep:
    """The positions :meth:`PhysicalKVAllocator.reserve` reserved: one decode token per
    branch, or ``num_tokens`` each.

    ``positions[i]`` is the first position reserved in ``branch_ids[i]``; ``slots`` (int64,
    on the pool device) the flat pool slots :meth:`~PhysicalKVAllocator.append` writes (the
    branches in order, each's positions in order);
    ``rows`` the branches' table rows; ``epoch`` the allocator's when it was reserved. Valid
    only in ``allocator`` (a step of another would write its slots), until one of its
    branches is forked from (the fork would share the step's blocks), freed or pruned (its
    blocks recycled).
    """
    branch_ids: np.ndarray
    positions: np.ndarray
    slots: torch.Tensor
    epoch: int
    rows: np.ndarray
    allocator: "PhysicalKVAllocator" = field(repr=False, compare=False)


@dataclass(frozen=True)
class MemoryReport:
    """Pool usage from the allocator's refcounts and tables. Block counts exclude the zero
    block (``blocks_reserved``). ``tokens_physical``: data-block slots inside at least one live
    branch's length (stored once however many branches read them); ``tokens_unwritten``:
    logical positions backed by the zero block. ``bytes_separate``: what the live branches
    would take with no sharing (each its own ``ceil(length / block_size)`` blocks)."""
    num_layers: int
    block_size: int
    bytes_per_token_per_layer: int
    blocks_total: int
    blocks_reserved: int
    blocks_used: int
    blocks_free: int
    tokens_logical: int
    tokens_physical: int
    tokens_unwritten: int
    bytes_used_per_layer: int
    bytes_separate_per_layer: int

    @property
    def bytes_saved_per_layer(self) -> int:
        return self.bytes_separate_per_layer - self.bytes_used_per_layer

    @property
    def bytes_used(self) -> int:
        return self.bytes_used_per_layer * self.num_layers

    @property
    def bytes_separate(self) -> int:
        return self.bytes_separate_per_layer * self.num_layers

    @property
    def bytes_saved(self) -> int:
        return self.bytes_saved_per_layer * self.num_layers

    def to_dict(self) -> dict[str, int]:
        totals = ("bytes_saved_per_layer", "bytes_used", "bytes_separate", "bytes_saved")
        return {**asdict(self), **{name: getattr(self, name) for name in totals}}


class PhysicalKVAllocator:
    """Paged K/V pools shared by the branches of a tree, with refcounts and copy-on-write.

    Pools: per layer ``k_pools[layer]``/``v_pools[layer]``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; a block id names the same slot in
    every layer, so a branch has one block table for all layers.

    **Zero block.** Block 0 is reserved: all zeros, never written, never on the free list
    (``num_blocks - 1`` blocks hold data). Every position that was never written maps to it,
    so ``alloc_branch`` allocates no data block and attention over unwritten tokens reads
    zeros. The invariant: every position below a branch's length reads the last value
    written to it along the branch's history (its own writes and its ancestors' writes before
    the fork), or zero.

    **Copy-on-write.** A fork shares every block below the fork position, a partial last
    block included (refcount += 1). The first write into the zero block or into a block with
    refcount > 1 copies it to a fresh block first, in every layer, K and V (when all holders
    of a shared block write it in one batched call, the last keeps it). When a branch grows
    over the rest of a block that holds data beyond its length (a sibling's, inherited by
    the copy), that rest is zeroed first.

    **All-or-nothing.** Every call validates its input, counts the blocks it needs and reserves
    the host memory it needs before changing anything: bad input raises
    ``ValueError``/``TypeError``/:class:`UnknownBranch`, too few free blocks
    :class:`PoolExhausted`, too little host memory ``MemoryError``, and the state is then
    exactly as before. A call that changes nothing (``alloc_branches(0, ...)``, ``reserve([])``,
    an empty write) leaves ``tree_version`` and ``table_version`` as they were.

    **Limits.** A branch holds at most :attr:`max_tokens` tokens, ``min(num_blocks - 1,
    MAX_TOKENS // block_size) * block_size``: its positions lie in distinct slots of the pool's
    data blocks, and lengths are int32 in the kernels. Every growth checks it (``alloc_branch``,
    ``write``, ``reserve``/``append``); so a branch's row of the host table mirror (8 bytes per
    block of its length) costs at most 8 bytes per pool block, as the refcounts do.

    **Threads.** An allocator and its plans are safe to use from several threads: every public
    method holds the allocator's lock (a reentrant ``threading.RLock``, ``_lock``) while it reads
    or changes host-side state, so each call sees and leaves a consistent state. Calls are
    serialised, not parallel; a plan built by one thread goes stale (``StalePlan``) when another
    forks, frees, prunes or overwrites, as it would in one thread. ``host_tables`` returns a view
    that stays consistent only while the caller holds ``_lock``.

    **Lengths.** ``write(branch, layer, k, v, start)`` writes positions
    ``start..start+n-1`` (``start <= length``, no holes) and grows the branch to cover them;
    the other layers then write the same span. A decode step is ``step = reserve(ids)`` (one
    vectorised call: copy-on-write, new blocks, every length += 1) followed by
    ``append(step, layer, k, v)`` once per layer (one ``write_slots`` launch each). With one
    layer, ``append(ids, 0, k, v)`` does both. A step stays valid until one of its branches
    is forked from, freed or pruned (that may share or recycle its blocks); other branches'
    forks and frees (another thread's, say) leave it valid.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_layers: int = 1, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cuda") -> None:
        self.num_blocks = as_int("num_blocks", num_blocks, low=1, high=MAX_BLOCKS)
        self.block_size = as_int("block_size", block_size, low=1, high=MAX_TOKENS)
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, low=1)
        self.head_dim = as_int("head_dim", head_dim, low=1)
        self.num_layers = as_int("num_layers", num_layers, low=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        device = _parse_device(device)
        if device.type == "cuda":  # the kernels take 16-bit words
            check_compiled("the allocator", dtype)
            _check_cuda_available(device)
        #: The longest branch: see "Limits" above.
        self.max_tokens = min(self.num_blocks - 1, MAX_TOKENS // self.block_size) * self.block_size
        self._max_columns = self.max_tokens // self.block_size
        self._lock = threading.RLock()
        kv = torch.empty((self.num_layers, 2, self.num_blocks, self.block_size,
                          self.num_kv_heads, self.head_dim), dtype=dtype, device=device)
        kv[:, :, ZERO_BLOCK].zero_()
        self.dtype, self.device = dtype, kv.device
        self.k_pools = tuple(kv[layer, 0] for layer in range(self.num_layers))
        self.v_pools = tuple(kv[layer, 1] for layer in range(self.num_layers))
        # Every pool at once, blocks first ([blocks, K/V, layers, ...]): a copy-on-write copies
        # a block in all of them with one gather and one scatter, not two per pool.
        self._blocks_first = kv.transpose(0, 2)
        # Blocks: refcount (0 for the zero block and free blocks); fill[b]: offsets >= fill[b]
        # of block b hold zeros (an upper bound); the free list is a stack popping low ids.
        self._refcount = np.zeros(self.num_blocks, np.int64)
        self._fill = np.zeros(self.num_blocks, np.int64)
        self._free = np.arange(self.num_blocks - 1, 0, -1, dtype=np.int64)
        self._free_top = self.num_blocks - 1
        # Branches: one row per live branch in the table mirror; entries at and beyond
        # ceil(length / block_size) are always the zero block.
        self._tables = np.zeros((16, 8), np.int64)  # int64: numpy indexes fastest with it
        self._lengths = np.zeros(16, np.int64)
        self._free_rows = np.arange(15, -1, -1, dtype=np.int64)  # a stack, like _free
        self._free_rows_top = 16
        self._row_of = np.full(64, -1, np.int64)  # branch id -> row, -1 once dead
        self._next_id = 0
        self._branches: dict[int, Branch] = {}
        # Fork history per live branch: (start, ancestor id) segments; token t came from the
        # ancestor of the last segment starting at or before t. Survives freed ancestors.
        self._lineage: dict[int, tuple[tuple[int, int], ...]] = {}
        # Nearest live ancestor and live children, for prune.
        self._live_parent: dict[int, int | None] = {}
        self._live_children: dict[int, set[int]] = {}
        self._epoch = 0          # bumped by calls that may share or recycle blocks
        # Per table row, the _epoch at which its branch was last forked from, freed or
        # created: a decode step is stale only where one of its rows changed after it.
        self._row_epoch = np.zeros(16, np.int64)
        self._table_epoch = 0    # bumped when any table entry changes
        self._length_epoch = 0   # bumped when any length changes
        self._overwrites = 0     # bumped by writes over tokens a branch already had
        self._cache: tuple | None = None

    # ---- queries -------------------------------------------------------------------------

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.k_pools[0].element_size()

    @_locked
    def is_alive(self, branch_id: int) -> bool:
        return branch_id in self._branches

    @_locked
    def branch(self, branch_id: int) -> Branch:
        self._row(branch_id)
        return self._branches[int(branch_id)]

    @_locked
    def length(self, branch_id: int) -> int:
        return int(self._lengths[self._row(branch_id)])

    @_locked
    def lengths(self, branch_ids: Sequence[int]) -> np.ndarray:
        """Each branch's length (an int64 copy, on the host)."""
        return self._lengths[self._rows(branch_ids)[1]].astype(np.int64)

    @property
    def tree_version(self) -> tuple[int, int]:
        """Changes whenever a segment tree may change other than by branches growing
        (alloc, free, prune, overwriting tokens): a plan built at one version is stale at
        another. ``reserve``/``append`` and writes that only extend branches keep it."""
        with self._lock:
            return self._epoch, self._overwrites

    @property
    def table_version(self) -> tuple[int, int]:
        """Changes whenever a block table entry or a length changes."""
        with self._lock:
            return self._table_epoch, self._length_epoch

    @_locked
    def live_branch_ids(self) -> list[int]:
        return sorted(self._branches)

    @_locked
    def block_tables(self, branch_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tables, lengths)`` for these branches, on the pool device: int32
        ``[n, max_blocks]`` (``max_blocks`` covers the longest; short rows are padded with
        the zero block) and int32 ``[n]``. Cached: unchanged tables/lengths are not
        re-uploaded; treat the tensors as read-only (a change makes new ones)."""
        _, rows = self._rows(branch_ids)
        lengths = self._lengths[rows]
        max_blocks = max(1, -(-int(lengths.max(initial=0)) // self.block_size))
        key = (rows.tobytes(), max_blocks)
        cached = self._cache
        if cached is not None and cached[0] == key and cached[1] == self._table_epoch:
            tables = cached[2]
        else:
            tables = self._upload(self._tables[rows, :max_blocks].astype(np.int32))
        if cached is not None and cached[0] == key and cached[3] == self._length_epoch:
            lengths_dev = cached[4]
        else:
            lengths_dev = self._upload(lengths.astype(np.int32))
        self._cache = (key, self._table_epoch, tables, self._length_epoch, lengths_dev)
        return tables, lengths_dev

    @_locked
    def host_tables(self, branch_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The host's copy of every block table (int64 ``[rows, columns]``, a read-only view,
        valid until the next call that changes a table) and each branch's row in it: what
        planning reads in place, with no copy and no device transfer. Another thread's call
        may change it: hold ``_lock`` while reading it."""
        _, rows = self._rows(branch_ids)
        view = self._tables.view()
        view.flags.writeable = False
        return view, rows

    @_locked
    def segment_tree(self, branch_ids: Sequence[int], q_lens=None,
                     query_block: int = 1, masked=None) -> SegmentTree:
        """The tree of token ranges these live branches share (see :class:`SegmentTree`).

        Two branches share token ``t`` when their fork histories agree up to ``t`` (same
        ancestor wrote it, before either fork) *and* ``t`` lies in the same physical block in
        both tables, for every token before ``t`` as well; a block copied on write after the
        fork is therefore no longer shared. Reads no KV data. With ``q_lens`` (query tokens
        per branch, each at most its length) the tree's rows are the queries'
        (``segment_tree.query_rows``, rounded to ``query_block``): branch ``i`` named
        ``q_lens[i]`` times, its row ``j`` holding the tokens its query ``j`` attends
        causally, or, for the branches ``masked`` names (bool per branch: draft masks), the
        tokens before its new ones."""
        ids, rows = self._distinct_rows(branch_ids)
        lengths = self._lengths[rows]
        if q_lens is not None:
            branch, offset = query_rows(check_q_lens(q_lens, lengths),
                                        as_int("query_block", query_block, low=1), masked)
            ids, rows, lengths = ids[branch], rows[branch], lengths[branch] + offset
        # With every token written the blocks alone tell sharing (a shared block is never
        # written, copy-on-write), as the C ABI reads it; 10x faster than the keys. Unwritten
        # tokens all map to the zero block whatever their history: then the keys tell.
        tree = SegmentTree.from_tables(ids, lengths, self._tables, self.block_size, rows,
                                       unwritten_block=ZERO_BLOCK)
        if tree is not None:
            return tree
        breaks = self._breakpoints(ids, lengths)
        return SegmentTree.from_keys(ids, lengths, breaks,
                                     self._position_keys(ids, rows, lengths, breaks))

    @_locked
    def memory_report(self) -> MemoryReport:
        rows = self._row_of[np.asarray(sorted(self._branches), np.int64)]
        lengths = self._lengths[rows]
        cols = -(-int(lengths.max(initial=0)) // self.block_size)
        blocks = self._tables[rows, :cols]
        # Positions of each table entry inside its branch's length.
        visible = np.clip(lengths[:, None] - self.block_size * np.arange(cols), 0,
                          self.block_size)
        per_block = np.zeros(self.num_blocks, np.int64)
        np.maximum.at(per_block, blocks.ravel(), visible.ravel())
        per_token = self.bytes_per_token_per_layer
        block_bytes = self.block_size * per_token
        used = int((self._refcount > 0).sum())
        separate_blocks = int((-(-lengths // self.block_size)).sum())
        return MemoryReport(
            num_layers=self.num_layers, block_size=self.block_size,
            bytes_per_token_per_layer=per_token, blocks_total=self.num_blocks - 1,
            blocks_reserved=1, blocks_used=used, blocks_free=self._free_top,
            tokens_logical=int(lengths.sum()),
            tokens_physical=int(per_block[ZERO_BLOCK + 1:].sum()),
            tokens_unwritten=int(visible[blocks == ZERO_BLOCK].sum()),
            bytes_used_per_layer=used * block_bytes,
            bytes_separate_per_layer=separate_blocks * block_bytes)

    # ---- branches ------------------------------------------------------------------------

    @_locked
    def alloc_branch(self, num_tokens: int, parent_branch_id: int | None = None,
                     fork_position: int | None = None) -> Branch:
        """A new branch of total length ``num_tokens``: a root (all positions read zero until
        written), or a fork of ``parent_branch_id`` sharing its positions below
        ``fork_position`` (default: the parent's length; ``0 <= fork_position <= parent
        length``, ``fork_position <= num_tokens <= max_tokens``); positions from the fork on read
        zero until written. Uses no data block, except one when the fork lies inside a block
        that holds parent data beyond the fork and ``num_tokens > fork_position``."""
        return self._alloc(1, num_tokens, parent_branch_id, fork_position)[0]

    @_locked
    def alloc_branches(self, count: int, num_tokens: int, parent_branch_id: int | None = None,
                       fork_position: int | None = None) -> list[Branch]:
        """``count`` new branches, each exactly what :meth:`alloc_branch` with these
        arguments makes (siblings: parallel sampling, a beam's expansion), in one vectorised
        call with consecutive ids; all-or-nothing. ``count`` 0 validates the arguments and
        changes nothing."""
        return self._alloc(as_int("count", count, low=0), num_tokens, parent_branch_id,
                           fork_position)

    def _alloc(self, count: int, num_tokens: int, parent_branch_id: int | None,
               fork_position: int | None) -> list[Branch]:
        num_tokens = as_int("num_tokens", num_tokens, low=0)
        self._check_limit("num_tokens", num_tokens)
        if parent_branch_id is None:
            if fork_position is not None:
                raise ValueError(f"fork_position={fork_position} needs a parent_branch_id")
            return self._new_branches(count, num_tokens, None, 0)[0] if count else []
        parent_branch_id = self._checked_id(parent_branch_id)
        parent_row = int(self._row_of[parent_branch_id])
        parent_length = int(self._lengths[parent_row])
        position = parent_length if fork_position is None else as_int(
            "fork_position", fork_position, low=0)
        if position > parent_length:
            raise ValueError(f"fork_position must lie in [0, {parent_length}] (the length of "
                             f"branch {parent_branch_id}), got {position}")
        if num_tokens < position:
            raise ValueError(f"num_tokens is the branch's total length and must be >= "
                             f"fork_position={position}, got {num_tokens}")
        col, offset = divmod(position, self.block_size)
        stale = (num_tokens > position and offset > 0
                 and self._fill[self._tables[parent_row, col]] > offset)
        if stale and self._free_top < count:
            raise PoolExhausted(count, self._free_top, f"forking branch {parent_branch_id} "
                                f"{count} times at {position}, inside a block holding data "
                                f"beyond it,")
        if count == 0:
            return []
        branches, rows = self._new_branches(count, num_tokens, parent_branch_id, position)
        shared = self._tables[parent_row, :-(-position // self.block_size)]
        self._tables[rows, :shared.size] = shared
        self._refcount[shared] += count  # a row holds each data block once
        self._refcount[ZERO_BLOCK] = 0  # cheaper than masking the zero block out first
        if stale:  # the children grow over the parent's data in that block: copy, zero the rest
            blocks = self._materialise(rows, np.full(count, col), "forking")
            self._zero_tails(blocks, np.full(count, offset))
        return branches

    @_locked
    def free_branch(self, branch_id: int) -> None:
        """Drop the branch; its blocks lose a reference and return to the free list at 0.
        Branches forked from it stay valid (they hold their own references)."""
        self._release([self._checked_id(branch_id)])

    @_locked
    def prune(self, branch_id: int) -> list[int]:
        """Free the branch and every live branch forked from it or from its descendants
        (also through freed ones); returns the freed ids."""
        pending, freed = [self._checked_id(branch_id)], []
        while pending:
            bid = pending.pop()
            freed.append(bid)
            pending.extend(self._live_children[bid])
        self._release(freed)
        return freed

    @_locked
    def truncate(self, branch_id: int, num_tokens: int) -> None:
        """Shorten the branch to its first ``num_tokens`` positions (``0 <= num_tokens <=
        length``): rejected draft tokens, a step rolled back. Nothing is copied: the blocks
        wholly past the new end lose the branch's reference (free at 0); the block holding
        the end is kept, and reads zero past it once the branch grows again. Branches forked
        from it keep every token they hold. Plans over the allocator go stale
        (``tree_version``), as do held decode steps of this branch. ``num_tokens == length``
        changes nothing."""
        row = self._row(branch_id)
        length = int(self._lengths[row])
        num_tokens = as_int("num_tokens", num_tokens, low=0)
        if num_tokens > length:
            raise ValueError(f"num_tokens must lie in [0, {length}] (branch {branch_id}'s "
                             f"length: truncate only shortens), got {num_tokens}")
        if num_tokens == length:
            return
        kept, held = -(-num_tokens // self.block_size), -(-length // self.block_size)
        self._drop_references(self._tables[row, kept:held])
        self._tables[row, kept:held] = ZERO_BLOCK
        self._set_lengths(row, num_tokens)
        # Positions from num_tokens on are the branch's own when it grows again.
        lineage = tuple(seg for seg in self._lineage[branch_id] if seg[0] < num_tokens)
        if not lineage or lineage[-1][1] != branch_id:
            lineage += ((num_tokens, branch_id),)
        self._lineage[branch_id] = lineage
        self._table_epoch += 1
        self._epoch += 1
        self._row_epoch[row] = self._epoch  # a held step of it reserved a dropped position

    # ---- writes --------------------------------------------------------------------------

    @_locked
    def write(self, branch_id: int, layer: int, k: torch.Tensor, v: torch.Tensor,
              start: int = 0) -> None:
        """Write ``k``/``v`` (``[n, num_kv_heads, head_dim]``) at positions
        ``start..start+n-1`` of the branch in ``layer``; ``start <= length`` and the branch
        grows to ``start + n`` when that is longer (at most :attr:`max_tokens`). Shared and zero
        blocks are copied first."""
        row = self._row(branch_id)
        check_layer(layer, self.num_layers)
        self._check_kv(k, v, None)
        length = int(self._lengths[row])
        start = as_int("start", start, low=0)
        if start > length:
            raise ValueError(f"start must lie in [0, {length}] (branch {branch_id}'s length; "
                             f"writes leave no holes), got {start}")
        n = k.shape[0]
        end = start + n
        if end > self.max_tokens:
            raise ValueError(f"writing {n} tokens at {start} would grow branch {branch_id} to "
                             f"{end} tokens; {self._limit_reason()}")
        if n == 0:
            return
        first, last = start // self.block_size, (end - 1) // self.block_size
        self._reserve_host(columns=last + 1, what=f"writing {n} tokens at {start}")
        cols = np.arange(first, last + 1)
        blocks = self._materialise(np.full(cols.size, row), cols,
                                   f"writing {n} tokens at {start} of branch {branch_id}")
        if start < length:
            self._overwrites += 1
        if end > length:
            grown = length // self.block_size - first
            self._zero_tails(blocks[grown:grown + 1], np.array([length % self.block_size]))
            self._set_lengths(row, end)
        positions = np.arange(start, end)
        slots = blocks[positions // self.block_size - first] * self.block_size
        kv_cache.write_slots(self.k_pools[layer], self.v_pools[layer],
                             self._upload(slots + positions % self.block_size), k, v,
                             validate=False)  # checked by _check_kv
        written = np.minimum(end - cols * self.block_size, self.block_size)
        self._fill[blocks] = np.maximum(self._fill[blocks], written)

    def reserve(self, branch_ids: Sequence[int] | DecodeStep,
                num_tokens: int | Sequence[int] = 1) -> DecodeStep:
        """Reserve position ``length`` in each branch for one decode step and advance every
        length by one; vectorised over branches, all-or-nothing. The reserved positions read
        zero until :meth:`append` writes them (per layer). A branch already holding
        :attr:`max_tokens` tokens is refused (``ValueError``).

        Passing the previous step (``step = reserve(step)``) reserves the next token of the
        same branches without converting and re-checking their ids: the decode loop's form.

        ``num_tokens`` (one count, or one per branch, each >= 0) reserves that many positions
        per branch instead: a continuation prompt or a draft to verify, for every branch at
        once; ``append`` then takes the branches' tokens in order."""
        with self._lock:
            if isinstance(branch_ids, DecodeStep):
                self._check_current(branch_ids)
                ids, rows = branch_ids.branch_ids, branch_ids.rows
            else:
                ids, rows = self._distinct_rows(branch_ids)
            if not (type(num_tokens) is int and num_tokens == 1):  # bool True is not a count
                return self._reserve_tokens(ids, rows, num_tokens)
            if rows.size == 0:  # changes nothing
                return DecodeStep(ids, ids.copy(), self._upload(ids), self._epoch, rows, self)
            positions = self._lengths[rows]
            cols, offsets = np.divmod(positions, self.block_size)
            top = int(cols.max())
            if top >= self._max_columns:  # max_tokens is a whole number of blocks
                full = int(ids[np.argmax(positions >= self.max_tokens)])
                raise ValueError(f"branch {full} holds {self.max_tokens} tokens: a decode step "
                                 f"cannot grow it; {self._limit_reason()}")
            what = f"a decode step of {rows.size} branches"
            if top >= self._tables.shape[1]:
                self._reserve_host(columns=top + 1, what=what)
            blocks = self._materialise(rows, cols, what)
            self._zero_tails(blocks, offsets)
            self._fill[blocks] = offsets + 1  # _zero_tails left every fill <= its offset
            self._set_lengths(rows, positions + 1)
            return DecodeStep(ids, positions, self._upload(blocks * self.block_size + offsets),
                              self._epoch, rows, self)

    def append(self, step: DecodeStep | Sequence[int], layer: int, k: torch.Tensor,
               v: torch.Tensor) -> DecodeStep:
        """Write ``k[i]``/``v[i]`` (``[n, num_kv_heads, head_dim]``) at the ``i``-th position
        ``step`` reserved (its branches in order, each's positions in order), in ``layer``: one
        ``write_slots`` call.

        ``step`` may be a list of branch ids when ``num_layers == 1``: then this is
        ``reserve`` plus the write. Returns the step."""
        with self._lock:
            n = step.slots.numel() if isinstance(step, DecodeStep) else _id_array(step).size
            check_layer(layer, self.num_layers)
            self._check_kv(k, v, n)
            if isinstance(step, DecodeStep):
                self._check_current(step)
            elif self.num_layers != 1:
                raise ValueError(f"append(branch_ids, ...) is the one-layer form; with "
                                 f"num_layers={self.num_layers} call step = "
                                 f"reserve(branch_ids) once per decode step, then "
                                 f"append(step, layer, k, v) per layer")
            else:
                step = self.reserve(step)
            kv_cache.write_slots(self.k_pools[layer], self.v_pools[layer], step.slots, k, v,
                                 validate=False)  # checked by _check_kv above
            return step

    def _reserve_tokens(self, ids: np.ndarray, rows: np.ndarray,
                        num_tokens: int | Sequence[int]) -> DecodeStep:
        """``reserve`` of ``num_tokens`` positions per branch (a count each, or one for all)."""
        counts = _token_counts(num_tokens, rows.size)
        positions = self._lengths[rows]
        ends = positions + counts
        if ends.size and int(ends.max()) > self.max_tokens:
            full = int(ids[np.argmax(ends > self.max_tokens)])
            raise ValueError(f"reserving {int(counts[np.argmax(ends > self.max_tokens)])} "
                             f"tokens would grow branch {full} past max_tokens; "
                             f"{self._limit_reason()}")
        growing = counts > 0
        if not growing.any():  # changes nothing
            return DecodeStep(ids, positions.copy(), self._upload(np.zeros(0, np.int64)),
                              self._epoch, rows, self)
        first = positions // self.block_size
        last = np.where(growing, (ends - 1) // self.block_size, first - 1)
        columns = last - first + 1  # per branch, 0 where it reserves nothing
        pair_rows = np.repeat(rows, columns)
        pair_cols = np.repeat(first, columns) + _ranks(columns)
        what = f"reserving {int(counts.sum())} tokens in {int(growing.sum())} branches"
        if int(last.max()) >= self._tables.shape[1]:
            self._reserve_host(columns=int(last.max()) + 1, what=what)
        blocks = self._materialise(pair_rows, pair_cols, what)
        heads = np.cumsum(columns) - columns  # each growing branch's first pair
        self._zero_tails(blocks[heads[growing]], (positions % self.block_size)[growing])
        pair_ends = np.repeat(ends, columns) - pair_cols * self.block_size
        self._fill[blocks] = np.maximum(self._fill[blocks], np.minimum(pair_ends, self.block_size))
        self._set_lengths(rows, ends)
        reserved = np.repeat(positions, counts) + _ranks(counts)
        pair_of = np.repeat(heads, counts) + reserved // self.block_size - np.repeat(first, counts)
        slots = blocks[pair_of] * self.block_size + reserved % self.block_size
        return DecodeStep(ids, positions.copy(), self._upload(slots), self._epoch, rows, self)

    # ---- internals: blocks ---------------------------------------------------------------

    def _materialise(self, rows: np.ndarray, cols: np.ndarray, what: str) -> np.ndarray:
        """Make each (row, col) entry an exclusive data block (distinct pairs); returns them.

        Zero-block entries and shared blocks are copied to fresh blocks (all layers, K and
        V); raises PoolExhausted before changing anything when too few are free."""
        blocks = self._tables[rows, cols]
        refcount = self._refcount[blocks]
        if (refcount == 1).all():  # the decode-step fast path: every block already exclusive
            return blocks
        copy = (refcount == 0) | self._must_copy_shared(blocks, refcount)
        needed = int(copy.sum())
        if needed > self._free_top:
            raise PoolExhausted(needed, self._free_top, what)
        src = blocks[copy]
        dst = self._free[self._free_top - needed:self._free_top][::-1].copy()
        # The copy first: it writes only free blocks, so a failing copy changes no state.
        kv_cache.copy_blocks(self._blocks_first, self._upload(src), self._upload(dst))
        self._free_top -= needed
        np.subtract.at(self._refcount, src[src != ZERO_BLOCK], 1)
        self._refcount[dst] = 1
        self._fill[dst] = self._fill[src]
        self._tables[rows[copy], cols[copy]] = dst
        blocks[copy] = dst
        self._table_epoch += 1
        return blocks

    def _must_copy_shared(self, blocks: np.ndarray, refcount: np.ndarray) -> np.ndarray:
        """Writes into shared blocks that must copy: all of them, except that when every
        holder of a block writes it in this call, the first writer keeps it."""
        shared = refcount > 1  # the zero block's refcount stays 0
        if not shared.any():
            return shared
        where = np.flatnonzero(shared)
        uniq, first, counts = np.unique(blocks[where], return_index=True, return_counts=True)
        shared[where[first[counts == self._refcount[uniq]]]] = False
        return shared

    def _zero_tails(self, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """Zero offsets ``[offset, fill)`` of exclusive blocks a branch is about to grow over,
        in every layer, so that the new positions read zero until written."""
        stale = self._fill[blocks] > offsets
        if not stale.any():  # the decode-step fast path
            return
        blocks, low = blocks[stale], offsets[stale]
        counts = self._fill[blocks] - low
        slots = self._upload(np.repeat(blocks * self.block_size + low, counts) + _ranks(counts))
        zeros = torch.zeros((slots.numel(), self.num_kv_heads, self.head_dim),
                            dtype=self.dtype, device=self.device)
        for k_pool, v_pool in zip(self.k_pools, self.v_pools):
            kv_cache.write_slots(k_pool, v_pool, slots, zeros, zeros, validate=False)
        self._fill[blocks] = low

    # ---- internals: branches -------------------------------------------------------------

    def _new_branches(self, count: int, num_tokens: int, parent_id: int | None,
                      position: int) -> tuple[list[Branch], np.ndarray]:
        """Register ``count`` (>= 1) branches with consecutive ids; returns them and their rows.
        Reserves the host memory first: nothing below the reservation can fail."""
        first = self._next_id
        self._reserve_host(rows=count, columns=-(-num_tokens // self.block_size),
                           ids=first + count, what=f"{count} new branches of {num_tokens} tokens")
        self._next_id += count
        rows = self._take_rows(count)
        self._row_of[first:self._next_id] = rows
        self._set_lengths(rows, num_tokens)
        inherited = () if parent_id is None else tuple(
            seg for seg in self._lineage[parent_id] if seg[0] < position)
        branches = []
        for bid in range(first, self._next_id):
            self._lineage[bid] = inherited + ((position, bid),)
            self._live_parent[bid] = parent_id
            self._live_children[bid] = set()
            self._branches[bid] = Branch(self, bid, parent_id, position)
            branches.append(self._branches[bid])
        if parent_id is not None:
            self._live_children[parent_id].update(range(first, self._next_id))
        self._epoch += 1
        self._row_epoch[rows] = self._epoch
        if parent_id is not None:  # a step of the parent may now write a shared block
            self._row_epoch[self._row_of[parent_id]] = self._epoch
        return branches, rows

    def _release(self, ids: list[int]) -> None:
        rows = self._row_of[np.asarray(ids, np.int64)]
        cols = -(-int(self._lengths[rows].max()) // self.block_size)
        self._drop_references(self._tables[rows, :cols])
        self._tables[rows, :cols] = ZERO_BLOCK
        self._set_lengths(rows, 0)
        self._row_of[np.asarray(ids, np.int64)] = -1
        self._free_rows[self._free_rows_top:self._free_rows_top + rows.size] = rows
        self._free_rows_top += rows.size
        for bid in ids:
            self._unlink(bid)
        self._table_epoch += 1
        self._epoch += 1
        self._row_epoch[rows] = self._epoch  # a step of these rows would write freed blocks

    def _drop_references(self, entries: np.ndarray) -> None:
        """One reference less for each data block among these table entries (the zero block
        skipped, a block listed by several rows counted each time); blocks left at 0 return
        to the free list, lowest on top."""
        held = entries[entries != ZERO_BLOCK]
        np.subtract.at(self._refcount, held, 1)
        freed = np.unique(held[self._refcount[held] == 0])
        self._free[self._free_top:self._free_top + freed.size] = freed[::-1]
        self._free_top += freed.size

    def _unlink(self, bid: int) -> None:
        """Forget a dead branch; its live children move to its nearest live ancestor."""
        parent, children = self._live_parent.pop(bid), self._live_children.pop(bid)
        if parent is not None:
            self._live_children[parent].discard(bid)
            self._live_children[parent].update(children)
        for child in children:
            self._live_parent[child] = parent
        del self._branches[bid], self._lineage[bid]

    def _set_lengths(self, rows: np.ndarray | int, lengths: np.ndarray | int) -> None:
        """Every caller changes at least one length."""
        self._lengths[rows] = lengths
        self._length_epoch += 1

    def _take_rows(self, count: int) -> np.ndarray:
        """``count`` free table rows, lowest first (reserved by :meth:`_reserve_host`)."""
        self._free_rows_top -= count
        return self._free_rows[self._free_rows_top:self._free_rows_top + count][::-1].copy()

    def _reserve_host(self, rows: int = 0, columns: int = 0, ids: int = 0,
                      what: str = "") -> None:
        """Grow the host mirror to hold ``rows`` more branches, ``columns`` table columns and
        branch ids below ``ids``. Capacity only (new rows and columns are the zero block, new
        ids unknown): every new array is allocated before any is installed, so running out of
        host memory raises ``MemoryError`` with nothing changed."""
        height, width = self._tables.shape
        new_height, new_width, new_ids = height, width, self._row_of.size
        while new_height - height + self._free_rows_top < rows:
            new_height *= 2
        if columns > width:  # columns <= _max_columns: the callers checked the limit
            new_width = max(columns, min(2 * width, self._max_columns))
        while new_ids < ids:
            new_ids *= 2
        grown = {}
        try:
            if (new_height, new_width) != (height, width):
                grown["_tables"] = np.zeros((new_height, new_width), np.int64)
                grown["_tables"][:height, :width] = self._tables
            if new_height > height:
                for name in ("_lengths", "_row_epoch"):
                    grown[name] = np.zeros(new_height, np.int64)
                    grown[name][:height] = getattr(self, name)
                # The new rows go under the stack's current entries: low rows are taken first.
                added, top = new_height - height, self._free_rows_top
                grown["_free_rows"] = np.zeros(new_height, np.int64)
                grown["_free_rows"][:added] = np.arange(new_height - 1, height - 1, -1)
                grown["_free_rows"][added:added + top] = self._free_rows[:top]
                grown["_free_rows_top"] = added + top
            if new_ids > self._row_of.size:
                grown["_row_of"] = np.full(new_ids, -1, np.int64)
                grown["_row_of"][:self._row_of.size] = self._row_of
        except MemoryError:
            raise MemoryError(f"{what}: growing the allocator's host tables to {new_height} "
                              f"rows x {new_width} columns and {new_ids} ids ran out of host "
                              f"memory ({8 * new_height * new_width:,} bytes for the block "
                              f"tables); nothing was changed") from None
        for name, value in grown.items():
            setattr(self, name, value)

    def _breakpoints(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Positions where some branch's block, ancestor or liveness may change."""
        top = int(lengths.max(initial=0))
        starts = [seg[0] for bid in ids.tolist() for seg in self._lineage[bid]]
        candidates = np.concatenate([np.arange(0, top, self.block_size), lengths,
                                     np.asarray(starts, np.int64), [0, top]])
        return np.unique(candidates[candidates <= top])

    def _position_keys(self, ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                       breaks: np.ndarray) -> np.ndarray:
        """keys[i, c] = (ancestor, physical block) of row i's tokens from breaks[c] on,
        -1 at and beyond its length."""
        segments = [(i, start, anc) for i, bid in enumerate(ids.tolist())
                    for start, anc in self._lineage[bid]]
        seg_row, seg_start, seg_anc = (np.asarray(a, np.int64) for a in zip(*segments)) \
            if segments else (np.zeros(0, np.int64),) * 3
        # Each segment's ancestor holds from its start column on: cumsum of the changes.
        change = seg_anc - np.where(seg_start > 0, np.roll(seg_anc, 1), 0)
        delta = np.zeros((ids.size, breaks.size), np.int64)
        # A segment past every row's end (a query row is shorter than its branch) keys nothing.
        inside = seg_start <= breaks[-1]
        np.add.at(delta, (seg_row[inside], np.searchsorted(breaks, seg_start[inside])),
                  change[inside])
        ancestor = np.cumsum(delta, axis=1)
        cols = np.minimum(breaks // self.block_size, self._tables.shape[1] - 1)
        blocks = self._tables[rows[:, None], cols[None, :]]
        keys = ancestor * self.num_blocks + blocks
        keys[breaks[None, :] >= lengths[:, None]] = -1
        return keys

    # ---- internals: validation -----------------------------------------------------------

    def _checked_id(self, branch_id: int) -> int:
        self._row(branch_id)
        return operator.index(branch_id)

    def _check_limit(self, name: str, tokens: int) -> None:
        if tokens > self.max_tokens:
            raise ValueError(f"{name} must be <= {self.max_tokens}, got {tokens}; "
                             f"{self._limit_reason()}")

    def _limit_reason(self) -> str:
        """Why a branch holds at most max_tokens tokens."""
        if self.max_tokens == (self.num_blocks - 1) * self.block_size:
            return (f"a branch holds at most max_tokens = {self.max_tokens}, the pool's "
                    f"{self.num_blocks - 1} data blocks of {self.block_size} tokens")
        return (f"a branch holds at most max_tokens = {self.max_tokens}, the whole blocks of "
                f"{self.block_size} tokens within the kernels' int32 lengths (MAX_TOKENS)")

    def _row(self, branch_id: int) -> int:
        bid = as_int("branch_id", branch_id)
        if bid not in self._branches:
            raise UnknownBranch(bid)
        return int(self._row_of[bid])

    def _rows(self, branch_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        ids = _id_array(branch_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self._next_id):
            bad = (ids < 0) | (ids >= self._next_id)
            raise UnknownBranch(int(ids[np.argmax(bad)]))
        rows = self._row_of[ids]
        if rows.size and rows.min() < 0:
            raise UnknownBranch(int(ids[np.argmax(rows < 0)]))
        return ids, rows

    def _distinct_rows(self, branch_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_rows`, rejecting a branch named twice (O(n): live ids own distinct rows)."""
        ids, rows = self._rows(branch_ids)
        order = np.arange(rows.size)
        mark = np.empty(self._lengths.size, np.int64)
        mark[rows] = order  # a repeated row keeps only its last index
        repeated = mark[rows] != order
        if repeated.any():
            dup = int(ids[np.argmax(repeated)])
            raise ValueError(f"branch_ids must be distinct, got {dup} "
                             f"{int((ids == dup).sum())} times")
        return ids, rows

    def _check_current(self, step: DecodeStep) -> None:
        if step.allocator is not self:
            raise ValueError("step was reserved by another allocator; reserve one from this "
                             "allocator's branch ids")
        # Forks and frees of other branches (another thread's, say) leave the step valid.
        if step.epoch != self._epoch and self._row_epoch[step.rows].max(initial=0) > step.epoch:
            raise ValueError("step is stale: one of its branches was forked from, freed or "
                             "pruned since reserve(); reserve a new step from branch ids")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, n: int | None) -> None:
        rows = k.shape[0] if n is None and isinstance(k, torch.Tensor) and k.dim() else n
        kv_cache.check_rows(k, v, (rows, self.num_kv_heads, self.head_dim), self.dtype,
                            self.device)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return runtime.upload(np.ascontiguousarray(array), self.device)


def _token_counts(num_tokens: int | Sequence[int], branches: int) -> np.ndarray:
    """``num_tokens`` as one int64 count (>= 0) per branch."""
    if isinstance(num_tokens, (bool, np.bool_)):
        raise TypeError("num_tokens must be an int or a sequence of ints, got a bool")
    if isinstance(num_tokens, (int, np.integer)):
        return np.full(branches, as_int("num_tokens", num_tokens, low=0), np.int64)
    counts = np.asarray(num_tokens)
    integral = counts.size == 0 or counts.dtype.kind in "iu"
    if counts.ndim != 1 or counts.size != branches or not integral:
        raise TypeError(f"num_tokens must be an int or {branches} ints (one per branch), got "
                        f"{num_tokens!r}")
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"num_tokens must be >= 0 each, got {int(counts.min())}")
    return counts.astype(np.int64)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _id_array(branch_ids: Sequence[int]) -> np.ndarray:
    """Branch ids as a 1-D int64 array; floats and bools are refused, not truncated. An int
    beyond int64 (a uint64 id, a Python int) names no branch: UnknownBranch with its value."""
    ids = np.asarray(branch_ids)
    if ids.size == 0:
        ids = ids.astype(np.int64)
    if ids.ndim == 1 and ids.dtype.kind in "fO" and not isinstance(branch_ids, np.ndarray):
        ids = _python_ids(branch_ids, ids)  # ints that numpy could not hold as int64/uint64
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(_not_ids(branch_ids, ids))
    if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and ids.size and ids.max() > _INT64_MAX:
        raise UnknownBranch(int(ids[np.argmax(ids > _INT64_MAX)]))
    return ids.astype(np.int64, copy=False)


def _python_ids(branch_ids: Sequence, ids: np.ndarray) -> np.ndarray:
    """A sequence numpy stored as float or object: ints of any size (-1 and 2**64 - 1 make
    float64), else a TypeError; an int beyond int64 raises UnknownBranch."""
    values = []
    for value in branch_ids:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(_not_ids(branch_ids, ids))
        try:
            values.append(operator.index(value))
        except TypeError:
            raise TypeError(_not_ids(branch_ids, ids)) from None
    for value in values:
        if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
            raise UnknownBranch(value)
    return np.array(values, np.int64)


def _not_ids(branch_ids, ids: np.ndarray) -> str:
    return (f"branch_ids must be a 1-D sequence of ints, got {type(branch_ids).__name__} of "
            f"dtype {ids.dtype}, shape {ids.shape}")


def _parse_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must name a torch device ('cuda', 'cuda:1', 'cpu'), got "
                         f"{device!r}") from None


def _check_cuda_available(device: torch.device) -> None:
    """A clear error where torch's would be an AssertionError ("Torch not compiled with CUDA
    enabled") or a driver message on first use."""
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} needs a CUDA GPU, but torch sees none "
                         f"(torch.cuda.is_available() is False: no GPU or driver, or a CPU-only "
                         f"torch); pass device='cpu' for the PyTorch path")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device={str(device)!r} names GPU {device.index}, but torch sees "
                         f"{count} GPU(s): cuda:0..cuda:{count - 1}")
