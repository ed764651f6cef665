"""``TreeCache``: a transformers ``Cache`` whose K/V live in one :class:`PhysicalKVAllocator`
for all layers. The batch's rows are branches of the allocator; fork, free, crop and beam
reordering are allocator operations (shared blocks, copy on write), never copies of the KV.

A forward through the model is one *step*: every row adds the same number of tokens. A step
of one token per row is a decode step: one ``reserve`` for all layers, one ``write_slots``
per layer, and attention through one :class:`TreeAttentionPlan` (or, with
``attention="paged"``, ``paged_decode`` over each row's path) that the step's layers share. A
step of several tokens is an extend step (a prompt, a continuation): one ``reserve`` and one
``write_slots`` per layer, attention by ``tree_attention`` with ``q_lens`` over stored paths
or SDPA for a prompt (``attention.py``).
"""
from __future__ import annotations

import contextvars
from collections.abc import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache

from .. import kv_cache, torch_path
from ..allocator import PhysicalKVAllocator
from ..ops.checks import as_int
from ..ops.paged_decode import paged_decode
from ..ops.tree_attention import TABLE_HEADROOM_BLOCKS, StalePlan, TreeAttentionPlan
from ..runtime import upload
from .support import ATTN_IMPLEMENTATION, attention_heads, check_model, head_dim_of

#: The cache whose ``update`` ran last in this context, and for which layer: the attention
#: function (called right after ``update`` by every supported model) finds its cache here,
#: since transformers does not pass the cache to attention functions.
_ACTIVE: contextvars.ContextVar[tuple[TreeCache, int] | None] = contextvars.ContextVar(
    "flash_reasoning_tree_cache", default=None)


def take_active(layer: int) -> TreeCache:
    """The cache that just stored ``layer``'s K/V; consumed, so a later forward without a
    :class:`TreeCache` cannot reuse it."""
    active = _ACTIVE.get()
    if active is None or active[1] != layer:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs "
                           f"past_key_values=TreeCache"
                           f"(...) in the forward: no TreeCache stored layer {layer}'s K/V "
                           f"just before its attention ran")
    _ACTIVE.set(None)
    return active[0]


#: Decode attention backends: ``tree`` reads each shared token once per step (the plan),
#: ``paged`` reads every row's whole path (``paged_decode``: beam search's, whose tree
#: changes every step, and the no-sharing baseline's).
ATTENTION_BACKENDS = ("tree", "paged")


class TreeCache(Cache):
    """K/V of ``model`` in a paged pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``branch_ids`` lists the branch of each row of the next forward's batch (set it with
    :meth:`set_batch`). Branches are made with :meth:`new_branch` and :meth:`fork`, dropped
    with :meth:`free` / :meth:`prune`. transformers' batch operations (``reorder_cache`` for
    beam search, ``batch_select_indices``, ``batch_repeat_interleave``, ``crop``) act on the
    rows by the same allocator operations.

    Rows of one forward all add the same number of tokens, at positions equal to their
    lengths: pass ``position_ids`` (:meth:`position_ids`) when the rows' lengths differ.
    Padding (an ``attention_mask`` with zeros) is not supported: transformers builds no mask
    for this attention implementation, so a padded batch must not be passed.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16,
                 attention: str = "tree") -> None:
        check_model(model)
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        super().__init__(layers=[])
        config = model.config
        parameter = next(model.parameters())
        self.num_layers = config.num_hidden_layers
        self.num_qo_heads, self.num_kv_heads = attention_heads(model)  # this rank's, under TP
        self.head_dim = head_dim_of(config)
        self.sm_scale = _attention_scaling(model, self.head_dim)
        self.allocator = PhysicalKVAllocator(
            as_int("num_blocks", num_blocks, low=2), as_int("block_size", block_size, low=1),
            self.num_kv_heads, self.head_dim, self.num_layers, parameter.dtype, parameter.device)
        self.attention = attention
        self._decode = (
            TreeDecodeAttention(self.allocator, self.num_qo_heads, self.sm_scale)
            if attention == "tree" else PagedDecodeAttention(self.allocator, self.sm_scale))
        self._rows: list[int] = []
        self._step: _Step | None = None
        self._last_reserve = None  # (DecodeStep, rows, tree_version): reserve(step) reuses it

    # ---- branches and rows ---------------------------------------------------------------

    @property
    def branch_ids(self) -> list[int]:
        """The branch of each row of the next forward's batch."""
        return list(self._rows)

    def set_batch(self, branch_ids: Sequence[int]) -> None:
        """Make ``branch_ids`` (live, distinct) the rows of the next forward, in order."""
        self._settle()
        ids = [as_int("branch_id", b) for b in branch_ids]
        for bid in ids:
            self.allocator.branch(bid)  # raises UnknownBranch
        if len(set(ids)) != len(ids):
            raise ValueError(f"branch_ids must be distinct, got {ids}")
        self._rows = ids

    def new_branch(self) -> int:
        """An empty branch (not in the batch)."""
        self._settle()
        return self.allocator.alloc_branch(0).branch_id

    def fork(self, branch_id: int, count: int, share: bool = True) -> list[int]:
        """``count`` new branches continuing ``branch_id`` from its current length (not in
        the batch). ``share=False`` gives each its own copy of the path instead (the
        no-sharing baseline: every token stored once per branch)."""
        self._settle()
        length = self.allocator.length(branch_id)
        if share:
            return [b.branch_id for b in self.allocator.alloc_branches(count, length, branch_id)]
        return self._copies(branch_id, as_int("count", count, low=0), length)

    def free(self, branch_id: int) -> None:
        """Drop ``branch_id`` (its forks keep the blocks they share) and its row, if any."""
        self._settle()
        self.allocator.free_branch(branch_id)
        self._rows = [b for b in self._rows if b != branch_id]

    def prune(self, branch_id: int) -> list[int]:
        """Drop ``branch_id`` and every branch forked from it (and their rows)."""
        self._settle()
        freed = set(self.allocator.prune(branch_id))
        self._rows = [b for b in self._rows if b not in freed]
        return sorted(freed)

    def length(self, branch_id: int) -> int:
        return self.allocator.length(branch_id)

    def lengths(self) -> list[int]:
        """The length of each row's branch (a step that failed midway undone first)."""
        self._settle(keep_begun=True)
        return self.allocator.lengths(self._rows).tolist()

    def position_ids(self, new_tokens: int = 1) -> torch.Tensor:
        """``[rows, new_tokens]`` positions of the next forward's tokens: each row's length
        before the step on."""
        starts = np.asarray(self._next_starts(), np.int64)
        return upload(starts[:, None] + np.arange(new_tokens), self.allocator.device)

    def regroup(self, sources: Sequence[int]) -> None:
        """New row ``i`` continues old row ``sources[i]``: the first row naming a source
        keeps its branch, later ones fork it, and old rows no row names are freed. Beam
        search's reordering, with no KV copied (a shared partial last block is copied on
        its next write)."""
        old = self._rows
        picks = [as_int("source row", s) for s in sources]
        if not picks:  # would free every row: free() says so when that is meant
            raise ValueError("sources must name at least one row")
        bad = [s for s in picks if not 0 <= s < len(old)]
        if bad:
            raise ValueError(f"source rows must lie in [0, {len(old) - 1}], got {bad[0]}")
        self._settle()
        rows, kept, forks = [], set(), []
        try:
            for source in picks:
                bid = old[source]
                if bid in kept:
                    bid = self.allocator.alloc_branch(self.allocator.length(bid), bid).branch_id
                    forks.append(bid)
                kept.add(old[source])
                rows.append(bid)
        except BaseException:  # all or nothing: the forks made so far go
            for bid in forks:
                self.allocator.free_branch(bid)
            raise
        for bid in old:
            if bid not in kept:
                self.allocator.free_branch(bid)
        self._rows = rows

    def truncate(self, branch_id: int, length: int) -> int:
        """``branch_id`` cut to its first ``length`` tokens (``allocator.truncate``: nothing
        copied, the id and its row kept). Returns the id."""
        self._settle()
        self.allocator.truncate(branch_id, length)
        return branch_id

    # ---- transformers' Cache interface ---------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new K/V (``[rows, kv_heads, new_tokens, head_dim]``, after
        RoPE). Layer 0 opens the step (unless :meth:`begin_step` did). Returns the inputs:
        the attention function reads the pool, not these. Under ``torch.compile`` it runs
        outside the graph (host-side bookkeeping)."""
        if torch.compiler.is_compiling():
            return _update_eager(self, key_states, value_states, layer_idx)
        return self._update(key_states, value_states, layer_idx)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, kv_heads, new_tokens, head_dim = key_states.shape
        if (rows, kv_heads, head_dim) != (len(self._rows), self.num_kv_heads, self.head_dim) \
                or value_states.shape != key_states.shape:
            raise ValueError(f"key_states and value_states must be [{len(self._rows)} rows, "
                             f"{self.num_kv_heads} KV heads, tokens, {self.head_dim}], got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}: "
                             f"set_batch() names the rows")
        if key_states.dtype != self.allocator.dtype or value_states.dtype != key_states.dtype:
            raise TypeError(f"key_states and value_states must be {self.allocator.dtype} (the "
                            f"pool's dtype), got {key_states.dtype} and {value_states.dtype}")
        if layer_idx == 0:
            self._open_step(new_tokens)
        step = self._step
        if step is None or step.new_tokens != new_tokens or layer_idx != step.layers_written:
            raise RuntimeError(f"TreeCache.update: layer {layer_idx} with {new_tokens} new "
                               f"tokens is not the next layer of the step "
                               f"({step.describe() if step else 'no step is open'})")
        # The step reserved every row's new positions: one launch writes them (rows in order,
        # each's tokens in order, as reserve lists their slots).
        shape = (-1, self.num_kv_heads, self.head_dim)
        kv_cache.write_slots(self.allocator.k_pools[layer_idx],
                             self.allocator.v_pools[layer_idx], step.slots,
                             key_states.transpose(1, 2).reshape(shape).contiguous(),
                             value_states.transpose(1, 2).reshape(shape).contiguous(),
                             validate=False)
        step.layers_written += 1
        _ACTIVE.set((self, layer_idx))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The rows' common length before the next forward (0 without rows); raises when
        they differ."""
        lengths = set(np.asarray(self._next_starts()).tolist())
        if len(lengths) > 1:
            raise ValueError(f"the rows' lengths differ ({sorted(lengths)}): there is no one "
                             f"sequence length; pass position_ids (TreeCache.position_ids())")
        return lengths.pop() if lengths else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.regroup(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.regroup(torch.as_tensor(indices).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.regroup([row for row in range(len(self._rows)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: remove that many tokens from every row; positive: cut every row to that
        length (transformers' two meanings)."""
        self._settle()
        for bid in list(self._rows):
            length = self.allocator.length(bid)
            keep = length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove,
                                                                                length)
            if keep < length:
                self.allocator.truncate(bid, max(keep, 0))

    def reset(self) -> None:
        for bid in self.allocator.live_branch_ids():
            self.allocator.free_branch(bid)
        self._rows, self._step = [], None

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    # ---- steps ---------------------------------------------------------------------------

    def begin_step(self, new_tokens: int, slots: torch.Tensor | None = None):
        """Open the next forward's step before it runs: a decode step (``new_tokens == 1``)
        reserves every row's next position and readies its attention (returns its key: the
        plan or tables it runs with, which change only when the tree does); ``slots``, when
        given, receives the reserved slots and is what the layers write (a CUDA graph's
        fixed buffer). Layer 0's ``update`` opens the step itself when this was not called."""
        self._settle()
        self._step = self._new_step(as_int("new_tokens", new_tokens, low=1), slots)
        self._step.external = True
        return self._step.key

    def complete_step(self) -> None:
        """Mark every layer of the open step written: a CUDA graph replay ran them (no Python
        runs in a replay, so no ``update`` counts them)."""
        if self._step is None:
            raise RuntimeError("complete_step: no step is open (begin_step opens one)")
        self._step.layers_written, self._step.external = self._step.num_layers, False

    @property
    def step_kind(self) -> str | None:
        return self._step.kind if self._step else None

    @property
    def step_starts(self) -> np.ndarray:
        """Each row's length before the open step."""
        return self._step.starts

    @property
    def plan_handle(self) -> int | None:
        """The handle of the open decode step's plan for the custom op
        ``flash_reasoning::tree_attention_run`` (None for the paged backend)."""
        return self._decode.plan_handle() if self.attention == "tree" else None

    def decode_attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention of the decode step's queries ``[rows, heads, head_dim]`` in ``layer``."""
        return self._decode.run(q, layer)

    def path_kv(self, branch_id: int, layer: int, length: int) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` of the first ``length`` tokens of a branch
        (a gather from the pool)."""
        tables, rows = self.allocator.host_tables([branch_id])
        positions = np.arange(length)
        slots = tables[rows[0], positions // self.allocator.block_size] \
            * self.allocator.block_size + positions % self.allocator.block_size
        index = upload(slots, self.allocator.device)
        shape = (-1, self.num_kv_heads, self.head_dim)
        return (self.allocator.k_pools[layer].view(shape)[index],
                self.allocator.v_pools[layer].view(shape)[index])

    def rollback(self) -> None:
        """Undo the last step: every row back to its length before it (same ids). Done by
        itself for a step a forward left half done (it raised between layers); call it when a
        forward raised after its last layer's attention."""
        step, self._step = self._step, None
        if step is None:
            return
        for row, bid in enumerate(list(self._rows)):
            if self.allocator.is_alive(bid) and self.allocator.length(bid) > step.starts[row]:
                self.allocator.truncate(bid, int(step.starts[row]))

    def _open_step(self, new_tokens: int) -> None:
        step = self._step
        if step is not None and step.external and step.layers_written == 0:
            step.external = False  # begin_step opened it for this forward
            return
        self._settle()
        self._step = self._new_step(new_tokens, None)

    def _new_step(self, new_tokens: int, slots: torch.Tensor | None) -> _Step:
        if not self._rows:
            raise ValueError("the batch is empty: set_batch() names the rows of a forward")
        starts = self.allocator.lengths(self._rows)  # the caller settled the last step
        if new_tokens > 1:  # all rows' new tokens reserved at once: all-or-nothing
            step = _Step("extend", new_tokens, starts, None, None, self.num_layers)
            step.slots = self.allocator.reserve(self._rows, new_tokens).slots
            return step
        step = self._step = _Step("decode", 1, starts, None, None, self.num_layers)
        try:  # the reservation is undone if readying the attention fails
            reserved = self._reserve()
            if slots is not None:
                slots.copy_(reserved.slots)
            step.slots = reserved.slots if slots is None else slots
            step.key = self._decode.prepare(self._rows)
        except BaseException:
            self.rollback()
            raise
        return step

    def _reserve(self):
        """``reserve`` of the rows' next positions; the previous step is passed back when
        the rows and the tree are unchanged (the allocator's fast path)."""
        alloc, last = self.allocator, self._last_reserve
        if last is not None and last[1] == self._rows and last[2] == alloc.tree_version:
            reserved = alloc.reserve(last[0])
        else:
            reserved = alloc.reserve(self._rows)
        self._last_reserve = (reserved, list(self._rows), alloc.tree_version)
        return reserved

    def _settle(self, keep_begun: bool = False) -> None:
        """Undo a step that is not complete: one a forward left half done (it raised between
        layers), and, unless ``keep_begun``, one :meth:`begin_step` opened for a forward
        that has not run (anything that changes the rows drops it)."""
        step = self._step
        if step is None or step.complete:
            return
        if keep_begun and step.external and step.layers_written == 0:
            return
        self.rollback()

    def _next_starts(self):
        """Each row's length before the next forward's tokens."""
        step = self._step
        if step is not None and step.external and step.layers_written == 0:
            return step.starts  # begun: the decode positions are already reserved
        return self.lengths()

    def _copies(self, branch_id: int, count: int, length: int) -> list[int]:
        alloc = self.allocator
        copies = [b.branch_id for b in alloc.alloc_branches(count, 0)]
        for layer in range(self.num_layers):
            k, v = self.path_kv(branch_id, layer, length)
            for bid in copies:
                alloc.write(bid, layer, k, v, 0)
        return copies


class _Step:
    """One forward's tokens: what each layer's ``update`` and attention need."""
    __slots__ = (
        "external",
        "key",
        "kind",
        "layers_written",
        "new_tokens",
        "num_layers",
        "slots",
        "starts",
    )

    def __init__(self, kind, new_tokens, starts, slots, key, num_layers) -> None:
        self.kind, self.new_tokens, self.starts = kind, new_tokens, starts
        self.slots, self.key, self.num_layers = slots, key, num_layers
        self.layers_written, self.external = 0, False

    @property
    def complete(self) -> bool:
        return self.layers_written == self.num_layers

    def describe(self) -> str:
        return (f"a {self.kind} step of {self.new_tokens} tokens with {self.layers_written} of "
                f"{self.num_layers} layers written")


class TreeDecodeAttention:
    """Decode attention through one :class:`TreeAttentionPlan` per tree: kept while the
    rows and the tree are unchanged (refreshed each step), rebuilt when they change. It
    holds the cache's allocator, never the cache: no reference cycle keeps a dropped cache's
    pools (and its CUDA graphs, which may hold a communicator) alive until the next collection."""

    def __init__(self, allocator: PhysicalKVAllocator, num_qo_heads: int, sm_scale: float) -> None:
        self.allocator, self.num_qo_heads, self.sm_scale = allocator, num_qo_heads, sm_scale
        self.plan: TreeAttentionPlan | None = None
        self._rows: list[int] = []

    def prepare(self, rows: list[int]) -> TreeAttentionPlan:
        alloc = self.allocator
        if self.plan is not None and rows == self._rows and \
                self.plan.tree_version == alloc.tree_version:
            try:
                self.plan.refresh()
                return self.plan
            except StalePlan:  # the branches outgrew the plan's tables
                pass
        self.plan = None  # a failed build must not leave the old plan in use
        self.plan = TreeAttentionPlan(alloc, rows, self.num_qo_heads, self.sm_scale)
        self._rows = list(rows)
        return self.plan

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        return self.plan.run(q, layer)

    def plan_handle(self) -> int:
        from ..ops import library  # registers the op on first use
        return library.plan_handle(self.plan)


class PagedDecodeAttention:
    """Decode attention by ``paged_decode`` over each row's whole path (no read shared), from
    tables held in fixed buffers (with headroom, like a plan's) so a CUDA graph can replay
    it after :meth:`prepare` refreshes them, whatever branches the rows hold: a fork, free or
    regroup keeps the buffers while the row count holds and the rows fit their headroom
    (``TABLE_HEADROOM_BLOCKS``). Holds the allocator, not the cache (as above)."""

    def __init__(self, allocator: PhysicalKVAllocator, sm_scale: float) -> None:
        self.allocator, self.sm_scale = allocator, sm_scale
        self.tables: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None

    def prepare(self, rows: list[int]) -> torch.Tensor:
        tables, lengths = self.allocator.block_tables(rows)
        if self.tables is None or len(rows) != self.tables.shape[0] or \
                tables.shape[1] > self.tables.shape[1]:
            self.tables = torch.zeros(len(rows), tables.shape[1] + TABLE_HEADROOM_BLOCKS,
                                      dtype=torch.int32, device=tables.device)
            self.lengths = torch.empty_like(lengths)
        self.tables[:, :tables.shape[1]].copy_(tables)  # columns past a row's length: unused
        self.lengths.copy_(lengths)
        return self.tables

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        alloc = self.allocator
        if q.is_cuda:
            return paged_decode(q, alloc.k_pools[layer], alloc.v_pools[layer], self.tables,
                                self.lengths, self.sm_scale)
        # paged_decode refuses dtypes and head_dims without kernels even on CPU, where its
        # PyTorch path runs any (as TreeAttentionPlan's does): call that path directly.
        out = torch.empty_like(q)
        torch_path.paged_decode(q, alloc.k_pools[layer], alloc.v_pools[layer], self.tables,
                                self.lengths, self.sm_scale, out)
        return out


_update_eager = torch.compiler.disable(TreeCache._update)


def _attention_scaling(model, head_dim: int) -> float:
    """The softmax scale the model's attention modules pass (``module.scaling``)."""
    for module in model.modules():
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "scaling", None), float):
            return module.scaling
    return head_dim ** -0.5
