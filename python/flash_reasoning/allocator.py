"""Refcounted paged KV-cache allocator: branches of a reasoning tree share KV blocks.

See :class:`PhysicalKVAllocator` and ``docs/allocator.md``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from . import kv_cache
from .ops.checks import as_int, check_compiled, check_layer
from .segment_tree import SegmentTree

#: The reserved all-zero, read-only block backing every never-written position.
ZERO_BLOCK = 0
#: The longest branch: the kernels hold lengths and positions in int32.
MAX_TOKENS = 2**31 - 1


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


class Branch:
    """A live view of one branch: ``length`` always reads the allocator's current length
    (and raises :class:`UnknownBranch` once the branch is freed). ``parent_id`` and
    ``fork_position`` record how it was created (``None``/0 for a root); the parent may have
    been freed since."""
    __slots__ = ("_allocator", "branch_id", "parent_id", "fork_position")

    def __init__(self, allocator: "PhysicalKVAllocator", branch_id: int,
                 parent_id: int | None, fork_position: int) -> None:
        self._allocator = allocator
        self.branch_id, self.parent_id, self.fork_position = branch_id, parent_id, fork_position

    @property
    def length(self) -> int:
        return self._allocator.length(self.branch_id)

    @property
    def alive(self) -> bool:
        return self._allocator.is_alive(self.branch_id)

    def __repr__(self) -> str:
        length = self.length if self.alive else "freed"
        return (f"Branch(branch_id={self.branch_id}, length={length}, "
                f"parent_id={self.parent_id}, fork_position={self.fork_position})")


@dataclass(frozen=True)
class DecodeStep:
    """One reserved decode token per branch (from :meth:`PhysicalKVAllocator.reserve`).

    ``positions[i]`` is the token position reserved in ``branch_ids[i]``; ``slots`` (int64,
    on the pool device) the flat pool slots :meth:`~PhysicalKVAllocator.append` writes;
    ``rows`` the branches' table rows (valid while ``epoch`` is the allocator's, and only in
    ``allocator``: a step of another would write its slots).
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

    **All-or-nothing.** Every call validates and computes the blocks it needs before changing
    anything: bad input raises ``ValueError``/``TypeError``/:class:`UnknownBranch`, too few
    free blocks :class:`PoolExhausted`, and the state is then exactly as before.

    **Lengths.** ``write(branch, layer, k, v, start)`` writes positions
    ``start..start+n-1`` (``start <= length``, no holes) and grows the branch to cover them;
    the other layers then write the same span. A decode step is ``step = reserve(ids)`` (one
    vectorised call: copy-on-write, new blocks, every length += 1) followed by
    ``append(step, layer, k, v)`` once per layer (one ``write_slots`` launch each). With one
    layer, ``append(ids, 0, k, v)`` does both. A step stays valid until the next
    ``alloc_branch``, ``free_branch`` or ``prune`` (they may share or recycle its blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_layers: int = 1, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cuda") -> None:
        self.num_blocks = as_int("num_blocks", num_blocks, low=1)
        self.block_size = as_int("block_size", block_size, low=1)
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, low=1)
        self.head_dim = as_int("head_dim", head_dim, low=1)
        self.num_layers = as_int("num_layers", num_layers, low=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if torch.device(device).type == "cuda":  # the kernels take 16-bit words
            check_compiled("the allocator", dtype)
        kv = torch.empty((self.num_layers, 2, self.num_blocks, self.block_size,
                          self.num_kv_heads, self.head_dim), dtype=dtype, device=device)
        kv[:, :, ZERO_BLOCK].zero_()
        self.dtype, self.device = dtype, kv.device
        self.k_pools = tuple(kv[layer, 0] for layer in range(self.num_layers))
        self.v_pools = tuple(kv[layer, 1] for layer in range(self.num_layers))
        self._pools = [pool for pair in zip(self.k_pools, self.v_pools) for pool in pair]
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
        self._table_epoch = 0    # bumped when any table entry changes
        self._length_epoch = 0   # bumped when any length changes
        self._overwrites = 0     # bumped by writes over tokens a branch already had
        self._cache: tuple | None = None

    # ---- queries -------------------------------------------------------------------------

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.k_pools[0].element_size()

    def is_alive(self, branch_id: int) -> bool:
        return branch_id in self._branches

    def branch(self, branch_id: int) -> Branch:
        self._row(branch_id)
        return self._branches[branch_id]

    def length(self, branch_id: int) -> int:
        return int(self._lengths[self._row(branch_id)])

    @property
    def tree_version(self) -> tuple[int, int]:
        """Changes whenever a segment tree may change other than by branches growing
        (alloc, free, prune, overwriting tokens): a plan built at one version is stale at
        another. ``reserve``/``append`` and writes that only extend branches keep it."""
        return self._epoch, self._overwrites

    @property
    def table_version(self) -> tuple[int, int]:
        """Changes whenever a block table entry or a length changes."""
        return self._table_epoch, self._length_epoch

    def live_branch_ids(self) -> list[int]:
        return sorted(self._branches)

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

    def host_tables(self, branch_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The host's copy of every block table (int64 ``[rows, columns]``, a read-only view,
        valid until the next call that changes a table) and each branch's row in it: what
        planning reads in place, with no copy and no device transfer."""
        _, rows = self._rows(branch_ids)
        view = self._tables.view()
        view.flags.writeable = False
        return view, rows

    def segment_tree(self, branch_ids: Sequence[int]) -> SegmentTree:
        """The tree of token ranges these live branches share (see :class:`SegmentTree`).

        Two branches share token ``t`` when their fork histories agree up to ``t`` (same
        ancestor wrote it, before either fork) *and* ``t`` lies in the same physical block in
        both tables, for every token before ``t`` as well; a block copied on write after the
        fork is therefore no longer shared. Reads no KV data."""
        ids, rows = self._distinct_rows(branch_ids)
        lengths = self._lengths[rows]
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

    def alloc_branch(self, num_tokens: int, parent_branch_id: int | None = None,
                     fork_position: int | None = None) -> Branch:
        """A new branch of total length ``num_tokens``: a root (all positions read zero until
        written), or a fork of ``parent_branch_id`` sharing its positions below
        ``fork_position`` (default: the parent's length; ``0 <= fork_position <= parent
        length <= ...``, ``num_tokens >= fork_position``); positions from the fork on read
        zero until written. Uses no data block, except one when the fork lies inside a block
        that holds parent data beyond the fork and ``num_tokens > fork_position``."""
        return self._alloc(1, num_tokens, parent_branch_id, fork_position)[0]

    def alloc_branches(self, count: int, num_tokens: int, parent_branch_id: int | None = None,
                       fork_position: int | None = None) -> list[Branch]:
        """``count`` new branches, each exactly what :meth:`alloc_branch` with these
        arguments makes (siblings: parallel sampling, a beam's expansion), in one vectorised
        call with consecutive ids; all-or-nothing."""
        return self._alloc(as_int("count", count, low=0), num_tokens, parent_branch_id,
                           fork_position)

    def _alloc(self, count: int, num_tokens: int, parent_branch_id: int | None,
               fork_position: int | None) -> list[Branch]:
        num_tokens = as_int("num_tokens", num_tokens, low=0, high=MAX_TOKENS)
        if parent_branch_id is None:
            if fork_position is not None:
                raise ValueError(f"fork_position={fork_position} needs a parent_branch_id")
            return self._new_branches(count, num_tokens, None, 0)[0]
        parent_row = self._row(parent_branch_id)
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
        branches, rows = self._new_branches(count, num_tokens, parent_branch_id, position)
        shared = self._tables[parent_row, :-(-position // self.block_size)]
        self._tables[rows, :shared.size] = shared
        self._refcount[shared] += count  # a row holds each data block once
        self._refcount[ZERO_BLOCK] = 0  # cheaper than masking the zero block out first
        if stale:  # the children grow over the parent's data in that block: copy, zero the rest
            blocks = self._materialise(rows, np.full(count, col), "forking")
            self._zero_tails(blocks, np.full(count, offset))
        return branches

    def free_branch(self, branch_id: int) -> None:
        """Drop the branch; its blocks lose a reference and return to the free list at 0.
        Branches forked from it stay valid (they hold their own references)."""
        self._release([self._checked_id(branch_id)])

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

    # ---- writes --------------------------------------------------------------------------

    def write(self, branch_id: int, layer: int, k: torch.Tensor, v: torch.Tensor,
              start: int = 0) -> None:
        """Write ``k``/``v`` (``[n, num_kv_heads, head_dim]``) at positions
        ``start..start+n-1`` of the branch in ``layer``; ``start <= length`` and the branch
        grows to ``start + n`` when that is longer. Shared and zero blocks are copied first."""
        row = self._row(branch_id)
        check_layer(layer, self.num_layers)
        self._check_kv(k, v, None)
        length = int(self._lengths[row])
        start = as_int("start", start, low=0)
        if start > length:
            raise ValueError(f"start must lie in [0, {length}] (branch {branch_id}'s length; "
                             f"writes leave no holes), got {start}")
        n = k.shape[0]
        if n == 0:
            return
        end = start + n
        first, last = start // self.block_size, (end - 1) // self.block_size
        self._ensure_columns(last + 1)
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

    def reserve(self, branch_ids: Sequence[int] | DecodeStep) -> DecodeStep:
        """Reserve position ``length`` in each branch for one decode step and advance every
        length by one; vectorised over branches, all-or-nothing. The reserved positions read
        zero until :meth:`append` writes them (per layer).

        Passing the previous step (``step = reserve(step)``) reserves the next token of the
        same branches without converting and re-checking their ids: the decode loop's form."""
        if isinstance(branch_ids, DecodeStep):
            self._check_current(branch_ids)
            ids, rows = branch_ids.branch_ids, branch_ids.rows
        else:
            ids, rows = self._distinct_rows(branch_ids)
        positions = self._lengths[rows]
        cols, offsets = np.divmod(positions, self.block_size)
        if rows.size:
            self._ensure_columns(int(cols.max()) + 1)
        blocks = self._materialise(rows, cols, f"a decode step of {rows.size} branches")
        self._zero_tails(blocks, offsets)
        self._fill[blocks] = offsets + 1  # _zero_tails left every fill <= its offset
        self._set_lengths(rows, positions + 1)
        return DecodeStep(ids, positions, self._upload(blocks * self.block_size + offsets),
                          self._epoch, rows, self)

    def append(self, step: DecodeStep | Sequence[int], layer: int, k: torch.Tensor,
               v: torch.Tensor) -> DecodeStep:
        """Write ``k[i]``/``v[i]`` (``[n, num_kv_heads, head_dim]``) at the position ``step``
        reserved in its ``i``-th branch, in ``layer``: one ``write_slots`` call.

        ``step`` may be a list of branch ids when ``num_layers == 1``: then this is
        ``reserve`` plus the write. Returns the step."""
        n = (step.branch_ids if isinstance(step, DecodeStep) else _id_array(step)).size
        check_layer(layer, self.num_layers)
        self._check_kv(k, v, n)
        if isinstance(step, DecodeStep):
            self._check_current(step)
        elif self.num_layers != 1:
            raise ValueError(f"append(branch_ids, ...) is the one-layer form; with "
                             f"num_layers={self.num_layers} call step = reserve(branch_ids) "
                             f"once per decode step, then append(step, layer, k, v) per layer")
        else:
            step = self.reserve(step)
        kv_cache.write_slots(self.k_pools[layer], self.v_pools[layer], step.slots, k, v,
                             validate=False)  # checked by _check_kv above
        return step

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
        self._free_top -= needed
        kv_cache.copy_blocks(self._pools, self._upload(src), self._upload(dst))
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
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        slots = self._upload(np.repeat(blocks * self.block_size + low, counts) + within)
        zeros = torch.zeros((slots.numel(), self.num_kv_heads, self.head_dim),
                            dtype=self.dtype, device=self.device)
        for k_pool, v_pool in zip(self.k_pools, self.v_pools):
            kv_cache.write_slots(k_pool, v_pool, slots, zeros, zeros, validate=False)
        self._fill[blocks] = low

    # ---- internals: branches -------------------------------------------------------------

    def _new_branches(self, count: int, num_tokens: int, parent_id: int | None,
                      position: int) -> tuple[list[Branch], np.ndarray]:
        """Register ``count`` branches with consecutive ids; returns them and their rows."""
        first = self._next_id
        self._next_id += count
        rows = self._take_rows(count)
        while self._next_id > self._row_of.size:
            self._row_of = np.concatenate([self._row_of, np.full(self._row_of.size, -1)])
        self._row_of[first:self._next_id] = rows
        self._ensure_columns(-(-num_tokens // self.block_size))
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
        return branches, rows

    def _release(self, ids: list[int]) -> None:
        rows = self._row_of[np.asarray(ids, np.int64)]
        cols = -(-int(self._lengths[rows].max()) // self.block_size)
        held = self._tables[rows, :cols]
        held = held[held != ZERO_BLOCK]
        np.subtract.at(self._refcount, held, 1)
        freed = np.unique(held[self._refcount[held] == 0])
        self._free[self._free_top:self._free_top + freed.size] = freed[::-1]
        self._free_top += freed.size
        self._tables[rows, :cols] = ZERO_BLOCK
        self._set_lengths(rows, 0)
        self._row_of[np.asarray(ids, np.int64)] = -1
        self._free_rows[self._free_rows_top:self._free_rows_top + rows.size] = rows
        self._free_rows_top += rows.size
        for bid in ids:
            self._unlink(bid)
        self._table_epoch += 1
        self._epoch += 1

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
        self._lengths[rows] = lengths
        self._length_epoch += 1

    def _take_rows(self, count: int) -> np.ndarray:
        """``count`` free table rows, lowest first; the table doubles as needed."""
        while self._free_rows_top < count:
            old, top = self._lengths.size, self._free_rows_top
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
            self._lengths = np.concatenate([self._lengths, np.zeros_like(self._lengths)])
            # The new rows go under the stack's current entries: low rows are taken first.
            self._free_rows = np.concatenate([np.arange(2 * old - 1, old - 1, -1),
                                              self._free_rows[:top], np.zeros(old, np.int64)])
            self._free_rows_top = old + top
        self._free_rows_top -= count
        return self._free_rows[self._free_rows_top:self._free_rows_top + count][::-1].copy()

    def _ensure_columns(self, needed: int) -> None:
        have = self._tables.shape[1]
        if needed > have:
            grown = np.zeros((self._tables.shape[0], max(needed, 2 * have)), np.int64)
            grown[:, :have] = self._tables
            self._tables = grown

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
        np.add.at(delta, (seg_row, np.searchsorted(breaks, seg_start)), change)
        ancestor = np.cumsum(delta, axis=1)
        cols = np.minimum(breaks // self.block_size, self._tables.shape[1] - 1)
        blocks = self._tables[rows[:, None], cols[None, :]]
        keys = ancestor * self.num_blocks + blocks
        keys[breaks[None, :] >= lengths[:, None]] = -1
        return keys

    # ---- internals: validation -----------------------------------------------------------

    def _checked_id(self, branch_id: int) -> int:
        self._row(branch_id)
        return int(branch_id)

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
        if step.epoch != self._epoch:
            raise ValueError("step is stale: alloc_branch, free_branch or prune ran since "
                             "reserve(); reserve a new step from branch ids")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, n: int | None) -> None:
        rows = k.shape[0] if n is None and isinstance(k, torch.Tensor) and k.dim() else n
        kv_cache.check_rows(k, v, (rows, self.num_kv_heads, self.head_dim), self.dtype,
                            self.device)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        # A pageable copy (H100 host: 12.7 us for 2 KB) beats staging through pinned memory
        # for an asynchronous copy (21.7 us): torch's pin_memory costs more than it saves.
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


def _id_array(branch_ids: Sequence[int]) -> np.ndarray:
    """Branch ids as a 1-D int64 array; floats and bools are refused, not truncated."""
    ids = np.asarray(branch_ids)
    if ids.size == 0:
        ids = ids.astype(np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"branch_ids must be a 1-D sequence of ints, got "
                        f"{type(branch_ids).__name__} of dtype {ids.dtype}, "
                        f"shape {ids.shape}")
    return ids.astype(np.int64, copy=False)
