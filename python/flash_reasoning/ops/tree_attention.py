"""``tree_attention`` and its plan/run form: decode attention over a tree of branches that
reads each shared KV token once per step.

``TreeAttentionPlan`` is built once per decode step (or kept while the branches only grow):
the C++ core plans the tree and lists its launches (``csrc/ops/tree_attention_plan.cc``, the
same code the C ABI runs), and the plan allocates the one workspace they read (work lists,
block tables, lengths, partials). ``run`` launches them with this call's four pointers: it
allocates nothing and never synchronises, so it can be captured in a CUDA graph. On CPU
allocators ``run`` executes the same plan with the PyTorch path; a CPU plan made for an arch
(``planner.PlanOptions.arch``) also lists the launches, which Triton's interpreter runs.
"""
from __future__ import annotations

import functools
import weakref
from typing import Sequence

import numpy as np
import torch

from .. import _core, log, planner, runtime, torch_path
from ..allocator import PhysicalKVAllocator
from ..runtime import POINTER_ALIGN, Launch
from ..segment_tree import own_ids, query_rows
from .checks import (
    apart_bytes,
    as_int,
    check_apart,
    check_compiled,
    check_layer,
    check_masks,
    check_q_lens,
    check_scale,
    check_tensor,
)

#: Block-table columns a plan holds beyond the longest branch, so branches can grow by
#: this many blocks before the plan must be rebuilt.
TABLE_HEADROOM_BLOCKS = 64

#: Queries per block of a several-query plan (``segment_tree.query_rows``): each query's row
#: is planned with its new tokens rounded down to a multiple of this, so a block's queries
#: share the new tokens before it (computed once for the block, or folded, as the cost model
#: finds) and each reads at most this many of its own at run time. One token per row made a
#: chain the planner folded into every row: each query read all the new tokens before it.
QUERY_BLOCK = 64

#: The most queries a branch's draft mask covers: the kernels hold each query's allowed new
#: tokens in one 64-bit word (``csrc/ops/tree_attention_plan.h``'s DraftMask).
MAX_DRAFT_TOKENS = _core.MAX_DRAFT_TOKENS


class StalePlan(RuntimeError):
    """The allocator's tree changed since the plan was built (a branch was forked, freed,
    pruned or overwritten, or outgrew the plan's tables): build a new plan."""


class TreeAttentionPlan:
    """The work of one decode step over ``branch_ids`` of ``allocator``, for queries of
    ``num_qo_heads`` heads (a multiple of the allocator's KV heads): one query per branch, or
    with ``q_lens`` ``q_lens[i]`` queries for branch ``i``, its last ``q_lens[i]`` tokens
    (an extend step, or a chain of draft tokens to verify), each attending causally: query
    ``j`` to the branch's tokens below ``length - q_lens[i] + j + 1``, or with ``mask[i]`` (a
    draft tree to verify: bool ``[q_lens[i], q_lens[i]]``, True where query ``j`` may attend
    new token ``k``; at most :data:`MAX_DRAFT_TOKENS` queries) to the tokens before the new
    ones and the new tokens its row allows. ``mask`` holds one entry per branch, ``None`` for
    a causal one (the plan keeps a copy: :attr:`mask`).

    Valid while the allocator's :attr:`~PhysicalKVAllocator.tree_version` is unchanged:
    ``reserve``/``append`` steps keep it (``run`` picks up the new lengths and tables), any
    fork, free, prune or overwrite makes ``run`` raise :class:`StalePlan`. For a CUDA graph,
    capture ``run`` and call :meth:`refresh` before each replay that follows a decode step.
    The output is softmax attention with natural-log LSE merges (not base 2). The plan keeps
    its own copy of ``branch_ids`` (and ``q_lens``). ``_options`` (a ``planner.PlanOptions``)
    forces the planner's choices, for tests and the tuner.

    Several queries per branch are planned as one row each (``segment_tree.query_rows``).
    Where a branch's queries fill the kernels' tiles (``planner.PlanOptions.query_tiles``), the
    plan is *query tiles*: one program per tile of a branch's consecutive queries (x the GQA
    group) and KV head walks the branch once for all of them, each query to its own causal end
    or mask, in one launch (``tree_queries``). Otherwise it is a tree plan over the rows, in
    blocks of :data:`QUERY_BLOCK` queries: a branch's context is read once for all its queries
    and all the branches sharing it, as for decode rows, each block's new tokens once for the
    later blocks, and each query reads its own block's new tokens itself. A masked branch's
    queries are planned at its context and each reads the new tokens up to the last its mask
    allows in its final program, where the mask applies.
    """

    def __init__(self, allocator: PhysicalKVAllocator, branch_ids: Sequence[int],
                 num_qo_heads: int, sm_scale: float | None = None,
                 q_lens: Sequence[int] | None = None, mask: Sequence | None = None, *,
                 _options: planner.PlanOptions | None = None) -> None:
        if not isinstance(allocator, PhysicalKVAllocator):
            raise TypeError(f"allocator must be a PhysicalKVAllocator, got "
                            f"{type(allocator).__name__}")
        options = _options if _options is not None else planner.PlanOptions()
        if not isinstance(options, planner.PlanOptions):
            raise TypeError(f"_options must be a planner.PlanOptions, got {type(options).__name__}")
        self._allocator = allocator
        self.num_qo_heads = _check_heads(num_qo_heads, allocator.num_kv_heads)
        self.head_dim = allocator.head_dim
        self.sm_scale = check_scale(sm_scale, self.head_dim)
        device = allocator.device
        if device.type == "cuda" or options.arch is not None:  # the kernels will run: compiled?
            check_compiled("allocator", allocator.dtype, self.head_dim)
        self._context = _context_for(device, options)
        with allocator._lock:  # the tree and the tables of one moment, with their versions
            self.q_lens = None if q_lens is None else \
                check_q_lens(q_lens, allocator.lengths(branch_ids))
            masks = _check_mask(mask, self.q_lens)
            masked = None if masks is None else _masked(masks, self.q_lens)
            tree = allocator.segment_tree(branch_ids, self.q_lens,  # ids: alive, distinct
                                          options.query_block or QUERY_BLOCK, masked)
            # A query row may be planned shorter than its branch; the tables cover the branch.
            longest = tree.lengths if q_lens is None else allocator.lengths(branch_ids)
            tables = _dense_tables(allocator, tree, int(longest.max(initial=0)))
            self.tree_version = allocator.tree_version
            # A several-query plan's rows were planned shorter (QUERY_BLOCK): its first
            # refresh (below) writes their lengths.
            self._table_version = allocator.table_version if q_lens is None else None
        # The tree's own read-only copy (its rows name a branch once per query with q_lens).
        self.branch_ids = tree.branch_ids if q_lens is None else own_ids(branch_ids)
        self.num_rows = int(tree.branch_ids.size)
        self.arch = self._context.arch if self._context is not None else None
        self.num_sms = options.num_sms or (self._context.num_sms if self._context else 1)
        # The core sizes its tables from the rows' lengths: a query row may be shorter than
        # its branch, whose columns the plan must hold too.
        planned = -(-int(tree.lengths.max(initial=0)) // allocator.block_size)
        headroom = TABLE_HEADROOM_BLOCKS + max(0, tables.shape[1] - planned)
        #: The masks (one per branch, None: causal; read-only copies), or None.
        self.mask = None if masks is None else [masks.get(i) for i in range(len(self.q_lens))]
        #: Each row's draft mask (int64 [num_rows, 2]: draft tokens, allowed bits), or None.
        self.draft_masks = None if masks is None else draft_masks(masks, self.q_lens)
        # Each query row's branch (query tiles group a branch's rows) and length offset.
        rows = None if q_lens is None else query_rows(self.q_lens, 1, masked)
        self._core = _core.TreePlan(self._context, self._shape(), tree, tables, headroom,
                                    options.core(), self.num_sms, self.draft_masks,
                                    None if rows is None else rows[0].astype(np.int32))
        self._make_workspace(device)
        self._query_rows = None if rows is None else \
            _device_query_rows(*rows, self.draft_masks, device)
        if q_lens is not None:
            self.refresh()
        if log.enabled():
            for kernel, _, _, rule, max_tokens, programs in self._core.launches:
                log.kernel_picked(kernel, rule, max_tokens, programs, self.num_sms, self.arch)
        # What run's quick check compares against (None: a CPU plan, which takes the full one).
        self._cuda_index = device.index if device.type == "cuda" else None
        self._io_shape = (self.num_rows, self.num_qo_heads, self.head_dim)
        # The allocator's pools are allocated once and never replaced: their pointers per layer.
        self._pool_pointers = [(k.data_ptr(), v.data_ptr())
                               for k, v in zip(allocator.k_pools, allocator.v_pools)]

    @property
    def allocator(self) -> PhysicalKVAllocator:
        return self._allocator

    @property
    def num_branches(self) -> int:
        return int(self.branch_ids.size)

    @functools.cached_property
    def arrays(self) -> planner.PlanArrays:
        """The planner's lists on the host (what the PyTorch path executes)."""
        return planner.PlanArrays(**self._core.arrays)

    @property
    def slot_runs(self) -> dict[int, int]:
        """Per row tile of ``arrays.items``: the runs of consecutive slots its partial launch
        reads each item as (1 or 2, the slot-run kernels; 0: the page kernels)."""
        return self._core.slot_runs

    @property
    def kernels(self) -> list[str]:
        """The manifest name of each launch's kernel, in launch order (the C ABI's
        ``frPlanKernelName``): the partial launches, then the final, merge or decode one."""
        return [launch[0] for launch in self._core.launches]

    @property
    def launch_picks(self) -> list[tuple[str, int, int]]:
        """Per launch: the rule list that picked its kernel, and the most tokens one program
        walks and the program count it was picked by (the tuner's keys)."""
        return [(rule, max_tokens, programs)
                for _, _, _, rule, max_tokens, programs in self._core.launches]

    def refresh(self) -> None:
        """Copy the allocator's current tables and lengths into the plan's buffers (a no-op
        when unchanged); raises :class:`StalePlan` when the plan no longer describes the
        tree. ``run`` calls it; graph users call it before a replay."""
        alloc = self._allocator
        if alloc.tree_version != self.tree_version:
            raise StalePlan("the allocator's tree changed since this plan was built (a fork, "
                            "free, prune or overwrite); build a new TreeAttentionPlan")
        if alloc.table_version == self._table_version:
            return
        with alloc._lock:
            tables, lengths = alloc.block_tables(self.branch_ids)
            version = alloc.table_version
        if self._query_rows is not None:  # each query's row: its branch's, causally shorter
            branch, offset = self._query_rows
            tables, lengths = tables[branch], lengths[branch] + offset
        if tables.shape[1] > self.tables.shape[1]:
            raise StalePlan(f"branches grew past the plan's {self.tables.shape[1]} table "
                            f"columns ({tables.shape[1]} needed); build a new plan")
        self.tables[:, :tables.shape[1]].copy_(tables)
        self.lengths.copy_(lengths)
        self._table_version = version

    def run(self, q: torch.Tensor, layer: int = 0, out: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Attention of ``q[i]`` (``[num_rows, num_qo_heads, head_dim]``, the pool's dtype)
        over branch ``branch_ids[i]`` in ``layer`` (with ``q_lens``: rows grouped by branch,
        ``q_lens[i]`` rows for branch ``i``); returns ``out``."""
        if not self._quick_check(q, layer, out):
            self._validate(q, layer, out)  # raises, saying what is wrong (or passes a subclass)
        self.refresh()
        out = torch.empty_like(q) if out is None else out
        if not self.num_rows:
            return out
        if q.is_cuda:
            k_pool, v_pool = self._pool_pointers[layer]
            self._core.run(q.data_ptr(), k_pool, v_pool, out.data_ptr(),
                           runtime.current_raw_stream(self._cuda_index))
        else:
            torch_path.tree_attention(self.arrays, q, self._allocator.k_pools[layer],
                                      self._allocator.v_pools[layer], self.tables,
                                      self.lengths, self.sm_scale, out)
        return out

    def launches(self, q, k_pool, v_pool, out) -> list[Launch]:
        """The plan's launches with these tensors (the partial launch of each row tile, then
        the final, merge or decode launch), as :class:`~flash_reasoning.runtime.Launch`
        records over the plan's workspace: for Triton's interpreter and the tuner."""
        pointers = dict(zip(_core.PLAN_POINTERS, (q, k_pool, v_pool, out)))
        return runtime.core_launches(self._core.launches, self.arch, pointers, self.workspace)

    def _shape(self) -> dict:
        """The attention call as the C++ core describes it."""
        alloc = self._allocator
        return {"num_qo_heads": self.num_qo_heads, "num_kv_heads": alloc.num_kv_heads,
                "head_dim": self.head_dim, "dtype": str(alloc.dtype).removeprefix("torch."),
                "block_size": alloc.block_size, "num_blocks": alloc.num_blocks,
                "sm_scale": self.sm_scale}

    def _make_workspace(self, device: torch.device) -> None:
        """The one buffer the launches read and write, filled with the plan's image (work
        lists, tables, lengths) by one host-to-device copy; views of its regions. A CUDA plan
        binds its launches to it."""
        core = self._core
        self.workspace = torch.empty(core.workspace_bytes, dtype=torch.uint8, device=device)
        image = core.image()
        runtime.upload_into(self.workspace[:image.size], image)
        view = {name: self.workspace[offset:offset + size]
                for name, (offset, size) in core.regions.items()}
        entries = core.regions["partial_lse"][1] // (4 * self.num_qo_heads)
        self.tables = view["tables"].view(torch.int32).view(self.num_rows, core.max_blocks)
        self.lengths = view["lengths"].view(torch.int32)
        self.partial_out = view["partial_out"].view(torch.float32).view(
            entries, self.num_qo_heads, self.head_dim)
        self.partial_lse = view["partial_lse"].view(torch.float32).view(entries, self.num_qo_heads)
        if device.type == "cuda":
            core.bind(self.workspace.data_ptr())

    def _weakly_held(self) -> TreeAttentionPlan:
        """This plan holding its allocator by a weak reference: for a cache keyed by the
        allocator, which must not keep it alive."""
        self._allocator = weakref.proxy(self._allocator)
        return self

    def _quick_check(self, q, layer, out) -> bool:
        """Whether a CUDA plan's ``run`` arguments certainly pass :meth:`_validate`: the same
        conditions as identity and integer compares, with no message to build. False sends
        them to the full check."""
        index = self._cuda_index
        return (index is not None and type(layer) is int
                and 0 <= layer < len(self._pool_pointers) and self._fits(q, index)
                and (out is None or self._fits(out, index) and apart_bytes(q, out) >= q.nbytes))

    def _fits(self, t, index: int) -> bool:
        return (type(t) is torch.Tensor and t.dtype is self._allocator.dtype and t.is_cuda
                and t.get_device() == index and t.shape == self._io_shape
                and t.is_contiguous() and not t.data_ptr() % POINTER_ALIGN)

    def _validate(self, q, layer, out) -> None:
        alloc = self._allocator
        for name, t in (("q", q), ("out", out)):
            if t is None:  # out only
                continue
            check_tensor(name, t, alloc.dtype, alloc.device, "the allocator")
            if tuple(t.shape) != self._io_shape:
                rows = "num_branches" if self.q_lens is None else "sum(q_lens)"
                raise ValueError(f"{name} must be [{rows}, num_qo_heads, head_dim] = "
                                 f"{self._io_shape}, got {tuple(t.shape)}")
        check_apart(q, out)
        check_layer(layer, alloc.num_layers)


def _context_for(device: torch.device, options: planner.PlanOptions):
    """The C++ context a plan's kernels come from: the device's for a CUDA allocator, a
    host-only one for a CPU plan made for an arch (the interpreter), none for the PyTorch
    path."""
    if device.type == "cuda":
        return runtime.context(device.index)
    if options.arch is None:
        return None
    return runtime.host_context(options.arch, options.num_sms or _core.HOST_ONLY_SMS)


def _device_query_rows(branch: np.ndarray, offset: np.ndarray, drafts: np.ndarray | None,
                       device: torch.device) -> tuple[torch.Tensor, ...]:
    """``segment_tree.query_rows``' rows on the plan's device, each row's draft tokens included
    (a masked branch's row ends at the last new token its mask allows): what ``refresh``
    gathers each query row's table and length with (no host round trip)."""
    if drafts is not None:
        offset = offset + drafts[:, 0]
    return (runtime.upload(branch, device), runtime.upload(offset.astype(np.int32), device))


def _check_mask(mask, q_lens: np.ndarray | None) -> dict[int, np.ndarray] | None:
    """The masked branches' draft masks (``checks.check_masks``), None without a mask."""
    if mask is None:
        return None
    if q_lens is None:
        raise ValueError("mask needs q_lens: it masks each branch's q_lens[i] new tokens")
    return check_masks(mask, q_lens, MAX_DRAFT_TOKENS) or None  # every branch causal: none


def _masked(masks: dict[int, np.ndarray], q_lens: np.ndarray) -> np.ndarray:
    """Which branches have a draft mask (bool per branch)."""
    masked = np.zeros(q_lens.size, bool)
    masked[list(masks)] = True
    return masked


def draft_masks(masks: dict[int, np.ndarray], q_lens: np.ndarray) -> np.ndarray:
    """Each query row's draft mask for the C++ plan, int64 ``[sum(q_lens), 2]``: row ``j`` of
    a masked branch holds its new tokens up to the last its mask row allows as draft tokens
    (a draft tree's query reads no token after itself, as a causal one) and that row's bits
    (bit k: new token k); a causal branch's rows none (0, 0)."""
    rows = np.zeros((int(q_lens.sum()), 2), np.int64)
    first = np.cumsum(q_lens) - q_lens
    for i, m in masks.items():
        n = int(q_lens[i])
        if not n:
            continue
        padded = np.zeros((n, 64), bool)
        padded[:, :n] = m
        bits = np.packbits(padded, axis=1, bitorder="little").view(np.uint64)[:, 0]
        tokens = np.where(m.any(axis=1), n - np.argmax(m[:, ::-1], axis=1), 0)
        rows[first[i]:first[i] + n] = np.stack([tokens, bits.view(np.int64)], axis=1)
    return rows


def _dense_tables(allocator: PhysicalKVAllocator, tree, longest: int) -> np.ndarray:
    """The tree's rows' block tables from the allocator's host mirror, one int32 row each (in
    the tree's row order) of the columns the ``longest`` branch covers (a query row may be
    planned shorter than its branch)."""
    mirror, rows = allocator.host_tables(tree.branch_ids)
    columns = max(1, -(-longest // allocator.block_size))
    return mirror[rows, :columns].astype(np.int32)


_plans: weakref.WeakKeyDictionary[PhysicalKVAllocator, tuple] = weakref.WeakKeyDictionary()


def tree_attention(q: torch.Tensor, allocator: PhysicalKVAllocator, branch_ids: Sequence[int],
                   layer: int = 0, out: torch.Tensor | None = None,
                   sm_scale: float | None = None,
                   q_lens: Sequence[int] | None = None,
                   mask: Sequence | None = None) -> torch.Tensor:
    """Decode attention of one query token per branch over its whole path in ``allocator``:
    ``q`` is ``[len(branch_ids), num_qo_heads, head_dim]``; returns the same shape in q's
    dtype. Shared tokens are read once for all the branches below them.

    ``q_lens``: several queries per branch (an extend step, a chain of draft tokens):
    ``q`` is ``[sum(q_lens), num_qo_heads, head_dim]``, rows grouped by branch in
    ``branch_ids`` order; branch ``i``'s last ``q_lens[i]`` tokens (written before the call)
    are its queries' and its query ``j`` attends causally, to the branch's tokens below
    ``length_i - q_lens[i] + j + 1``. ``mask`` (with ``q_lens``; one entry per branch,
    ``None`` or a bool ``[q_lens[i], q_lens[i]]``: a draft tree to verify): query ``j`` of a
    masked branch attends to the tokens before its new ones and to new token ``k`` where
    ``mask[i][j, k]`` (:class:`TreeAttentionPlan`). Each call reads ``mask`` on the host to
    match it against the cached plan's (CUDA masks: a copy and a sync per call); a held
    :class:`TreeAttentionPlan` reads them once.

    Keeps the last plan per allocator (never keeping the allocator alive) and reuses it while
    the branches, their tree and the head count are unchanged (the layers of one step, and
    steps that only append). Engines that want to control planning use
    :class:`TreeAttentionPlan` directly.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_branches, num_qo_heads, head_dim], got "
                         f"{tuple(q.shape)}")
    ids = np.asarray(branch_ids)
    cached = _plans.get(allocator) if isinstance(allocator, PhysicalKVAllocator) else None
    if cached is not None and cached[0] == (q.shape[1], sm_scale) and _same_ids(cached[1], ids) \
            and _same_q_lens(cached[1], q_lens) and _same_mask(cached[1], mask) \
            and cached[1].tree_version == allocator.tree_version:
        try:
            return cached[1].run(q, layer, out)
        except StalePlan:  # the branches outgrew its tables: plan again
            pass
    plan = TreeAttentionPlan(allocator, ids, q.shape[1], sm_scale, q_lens, mask)
    out = plan.run(q, layer, out)
    _plans[allocator] = ((q.shape[1], sm_scale), plan._weakly_held())  # only a plan that ran
    return out


def _same_ids(plan: TreeAttentionPlan, ids: np.ndarray) -> bool:
    """Whether ``ids`` are the plan's branches, in order (vectorised: no loop per branch)."""
    return ids.dtype.kind in "iu" and ids.shape == plan.branch_ids.shape and \
        bool((ids == plan.branch_ids).all())


def _same_q_lens(plan: TreeAttentionPlan, q_lens) -> bool:
    """Whether ``q_lens`` are the plan's (both None, or the same counts)."""
    if plan.q_lens is None or q_lens is None:
        return plan.q_lens is None and q_lens is None
    counts = np.asarray(q_lens.cpu() if isinstance(q_lens, torch.Tensor) else q_lens)
    return counts.dtype.kind in "iu" and counts.shape == plan.q_lens.shape and \
        bool((counts == plan.q_lens).all())


def _same_mask(plan: TreeAttentionPlan, mask) -> bool:
    """Whether ``mask`` gives the plan's draft masks (none, or the same bits)."""
    if mask is None or plan.q_lens is None:
        return mask is None and plan.draft_masks is None
    try:
        masks = check_masks(mask, plan.q_lens, MAX_DRAFT_TOKENS)
    except (TypeError, ValueError):
        return False  # planning again raises, saying what is wrong
    if not masks or plan.draft_masks is None:
        return not masks and plan.draft_masks is None
    return np.array_equal(draft_masks(masks, plan.q_lens), plan.draft_masks)


def _check_heads(num_qo_heads, num_kv_heads: int) -> int:
    num_qo_heads = as_int("num_qo_heads", num_qo_heads, low=1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads must be a positive multiple of the allocator's "
                         f"num_kv_heads ({num_kv_heads}), got {num_qo_heads}")
    return num_qo_heads

