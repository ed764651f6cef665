"""``tree_attention`` and its plan/run form: decode attention over a tree of branches that
reads each shared KV token once per step.

``TreeAttentionPlan`` is built once per decode step (or kept while the branches only grow):
it runs the planner, uploads the work lists and allocates every buffer ``run`` needs. ``run``
launches the partial kernel(s), then the final kernel (or, for a plan that merges separately,
the merge kernel; for a plan with no partials, ``paged_decode``'s kernel alone); it allocates
nothing and never synchronises, so it can be captured in a
CUDA graph. On CPU allocators ``run`` executes the
same plan with the PyTorch path.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Sequence

import numpy as np
import torch

from .. import dispatch, log, planner, runtime, specializations, torch_path
from ..allocator import PhysicalKVAllocator
from ..runtime import POINTER_ALIGN, Launch, TensorMap
from .checks import as_int, check_compiled, check_layer, check_scale, check_tensor
from .paged_decode import decode_scalars

#: Block-table columns a plan holds beyond the longest branch, so branches can grow by
#: this many blocks before the plan must be rebuilt.
TABLE_HEADROOM_BLOCKS = 64

#: The pointers each CUDA ``run`` passes to the plan's prepared launches, in this order; every
#: other argument is the plan's own and fixed for its lifetime.
PER_CALL_POINTERS = ("q", "k_pool", "v_pool", "out")


class StalePlan(RuntimeError):
    """The allocator's tree changed since the plan was built (a branch was forked, freed,
    pruned or overwritten, or outgrew the plan's tables): build a new plan."""


class TreeAttentionPlan:
    """The work of one decode step over ``branch_ids`` of ``allocator``, for queries of
    ``num_qo_heads`` heads (a multiple of the allocator's KV heads).

    Valid while the allocator's :attr:`~PhysicalKVAllocator.tree_version` is unchanged:
    ``reserve``/``append`` steps keep it (``run`` picks up the new lengths and tables), any
    fork, free, prune or overwrite makes ``run`` raise :class:`StalePlan`. For a CUDA graph,
    capture ``run`` and call :meth:`refresh` before each replay that follows a decode step.
    The output is softmax attention with natural-log LSE merges (not base 2).
    ``separate_merge``, ``flat``, ``final_lanes``, ``one_tile``, ``early_final`` and ``host_nodes``
    force the planner's choices (``flash_reasoning.planner``), for tuning and tests. The attribute
    ``contiguous`` holds, per row tile, the runs of consecutive slots its partial launch reads
    each range as (1 or 2 where its ranges lie in consecutive pages, broken at most once; 0:
    the paged kernels; ``planner.item_runs``); ``contiguous=False`` keeps every partial launch
    on the paged kernels, for comparisons.
    """

    def __init__(self, allocator: PhysicalKVAllocator, branch_ids: Sequence[int],
                 num_qo_heads: int, sm_scale: float | None = None,
                 target_chunk: int | None = None, num_sms: int | None = None,
                 arch: str | None = None, separate_merge: bool | None = None,
                 flat: bool | None = None, final_lanes: int | None = None,
                 one_tile: bool | None = None, early_final: bool | None = None,
                 host_nodes: bool | None = None, contiguous: bool | None = None) -> None:
        if not isinstance(allocator, PhysicalKVAllocator):
            raise TypeError(f"allocator must be a PhysicalKVAllocator, got "
                            f"{type(allocator).__name__}")
        self.allocator = allocator
        self.num_qo_heads = _check_heads(num_qo_heads, allocator.num_kv_heads)
        self.head_dim = allocator.head_dim
        self.sm_scale = check_scale(sm_scale, self.head_dim)
        device = allocator.device
        if device.type == "cuda" or arch is not None:  # the kernels will run: compiled?
            check_compiled("allocator", allocator.dtype, self.head_dim)
        for name, value in (("target_chunk", target_chunk), ("num_sms", num_sms)):
            if value is not None:
                as_int(name, value, low=1)
        if contiguous is not None and contiguous is not False:
            raise ValueError(f"contiguous must be None (where the pages allow) or False (never): "
                             f"only consecutive pages may be read as one run, got {contiguous!r}")
        tree = allocator.segment_tree(branch_ids)  # validates ids: alive, distinct
        self.branch_ids = tree.branch_ids
        self.tree_version = allocator.tree_version
        # arch/num_sms default to the device's; a CPU plan run through the interpreter names them.
        self.arch = arch or (runtime.arch_of(device.index) if device.type == "cuda" else None)
        self.num_sms = num_sms or (runtime.num_sms(device.index) if device.type == "cuda" else 1)
        shape = planner.Shape(self.num_qo_heads, allocator.num_kv_heads, self.head_dim,
                              allocator.k_pools[0].element_size(), self.num_sms)
        self.arrays = planner.plan(tree, shape, target_chunk, separate_merge=separate_merge,
                                   flat=flat, final_lanes=final_lanes, one_tile=one_tile,
                                   early_final=early_final, host_nodes=host_nodes)
        # Before the upload: two runs write each item's split into the plan's work buffer.
        self.contiguous = {} if contiguous is False else planner.item_runs(
            self.arrays, *allocator.host_tables(self.branch_ids), allocator.block_size)
        self._upload_work_lists(device)
        self.partial_out = torch.empty(self.arrays.num_entries, self.num_qo_heads,
                                       self.head_dim, dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(self.arrays.num_entries, self.num_qo_heads,
                                       dtype=torch.float32, device=device)
        tables, _ = allocator.block_tables(self.branch_ids)
        self.tables = torch.zeros(self.branch_ids.size,
                                  tables.shape[1] + TABLE_HEADROOM_BLOCKS,
                                  dtype=torch.int32, device=device)
        self.lengths = torch.zeros(self.branch_ids.size, dtype=torch.int32, device=device)
        self._table_version = None
        self.refresh()
        self._templates = self._launch_templates(tree.lengths) if self.arch else []
        self._prepared = None  # the templates' launches, packed by the launcher on first run
        # What run's quick check compares against (None: a CPU plan, which takes the full one).
        self._cuda_index = device.index if device.type == "cuda" else None
        self._io_shape = (self.num_branches, self.num_qo_heads, self.head_dim)
        # The allocator's pools are allocated once and never replaced: their pointers per layer.
        self._pool_pointers = [(k.data_ptr(), v.data_ptr())
                               for k, v in zip(allocator.k_pools, allocator.v_pools)]

    @property
    def num_branches(self) -> int:
        return int(self.branch_ids.size)

    def refresh(self) -> None:
        """Copy the allocator's current tables and lengths into the plan's buffers (a no-op
        when unchanged); raises :class:`StalePlan` when the plan no longer describes the
        tree. ``run`` calls it; graph users call it before a replay."""
        alloc = self.allocator
        if alloc.tree_version != self.tree_version:
            raise StalePlan("the allocator's tree changed since this plan was built (a fork, "
                            "free, prune or overwrite); build a new TreeAttentionPlan")
        if alloc.table_version == self._table_version:
            return
        tables, lengths = alloc.block_tables(self.branch_ids)
        if tables.shape[1] > self.tables.shape[1]:
            raise StalePlan(f"branches grew past the plan's {self.tables.shape[1]} table "
                            f"columns ({tables.shape[1]} needed); build a new plan")
        self.tables[:, :tables.shape[1]].copy_(tables)
        self.lengths.copy_(lengths)
        self._table_version = alloc.table_version

    def run(self, q: torch.Tensor, layer: int = 0, out: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Attention of ``q[i]`` (``[num_branches, num_qo_heads, head_dim]``, the pool's
        dtype) over branch ``branch_ids[i]`` in ``layer``; returns ``out``."""
        if not self._quick_check(q, layer, out):
            self._validate(q, layer, out)  # raises, saying what is wrong (or passes a subclass)
        self.refresh()
        out = torch.empty_like(q) if out is None else out
        if q.is_cuda:
            self._launch(q, layer, out)
        else:
            torch_path.tree_attention(self.arrays, q, self.allocator.k_pools[layer],
                                      self.allocator.v_pools[layer], self.tables,
                                      self.lengths, self.sm_scale, out)
        return out

    def _launch(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """The plan's launches with this call's pointers on torch's current stream. They
        are converted and checked once (on the first call): a call hands the launcher four
        pointers, which it checks (non-null, aligned) before launching anything."""
        if not self._templates:  # no branches: no work
            return
        prepared = self._prepared
        if prepared is None:
            prepared = self._prepared = runtime.prepare(self.launches, PER_CALL_POINTERS,
                                                        q.device)
        prepared.run((q.data_ptr(), *self._pool_pointers[layer], out.data_ptr()),
                     runtime.current_raw_stream(self._cuda_index))

    def launches(self, q, k_pool, v_pool, out) -> list[Launch]:
        """The partial launch of each tile size, then the final (or merge) launch: the
        templates built with the plan, completed with this call's tensors (or, for ``run``'s
        prepared launches, with placeholders for their pointers)."""
        given = dict(zip(PER_CALL_POINTERS, (q, k_pool, v_pool, out)))

        def complete(arg):
            if isinstance(arg, TensorMap):
                return dataclasses.replace(arg, base=complete(arg.base))
            return given[arg] if isinstance(arg, str) else arg

        return [Launch(spec, grid, tuple(map(complete, args)))
                for spec, grid, args in self._templates]

    def _launch_templates(self, lengths: np.ndarray) -> list[tuple]:
        """(spec, grid, arguments) of each launch, the per-call tensors named by their
        :data:`PER_CALL_POINTERS` name: everything else is fixed when the plan is built (the
        configs from the branches' ``lengths`` now). Sets ``launch_max_tokens``: the most
        tokens one program of each partial and final launch walks, what its config was
        picked by (the merge launch has one config)."""
        self.launch_max_tokens = [_longest_item(records) for records in self.arrays.items.values()]
        if not self.num_branches:
            return []
        dtype = str(self.allocator.dtype).removeprefix("torch.")
        kv_heads = self.allocator.num_kv_heads
        scalars = (self.sm_scale * math.log2(math.e), self.num_qo_heads, kv_heads,
                   self.allocator.block_size, self.tables.shape[1])
        paged = ("q", "k_pool", "v_pool", self.tables, self.lengths)
        templates = []
        for (block_m, records), items, tokens in zip(self.arrays.items.items(), self._items,
                                                     self.launch_max_tokens):
            spec = self._partial_spec(dtype, block_m, tokens, records.shape[0] * kv_heads)
            templates.append(
                (spec, ordered_grid(records.shape[0], kv_heads, self.arrays.heads_first[block_m]),
                 self._pool_args(spec, paged) + (self._order, items, self._entry_slot,
                                                 self.partial_out, self.partial_lse) + scalars
                 + (int(self.arrays.early_final), int(self.arrays.heads_first[block_m]))))
        if self.arrays.separate_merge:
            templates.append((dispatch.tree_merge_spec(dtype, self.head_dim, self.arch),
                              (self.num_branches, self.num_qo_heads, 1),
                              (self._merge_ptr, self.partial_out, self.partial_lse, "out",
                               self.num_qo_heads)))
            return templates
        # A packed program walks its lanes' final ranges side by side.
        lanes = self.arrays.final_lanes
        tiles = kv_heads * dispatch.decode_tiles_per_kv_head(self.num_qo_heads, kv_heads)
        grid = ordered_grid(-(-self.num_branches // lanes), tiles, self.arrays.final_heads_first)
        final_tokens = int((lengths - self.arrays.final_start).max()) * lanes
        self.launch_max_tokens.append(final_tokens)
        if self.arrays.as_paged_decode:
            templates.append(self._decode_template(dtype, grid, final_tokens, paged))
            return templates
        wide = self.arrays.final_block_m != dispatch.BLOCK_M
        common = self.arrays.has_common
        final_config = self._config(dispatch.tree_final_kernel(lanes > 1, wide, common), dtype,
                                    final_tokens, math.prod(grid))
        templates.append((dispatch.tree_final_spec(dtype, self.head_dim, self.arch, final_config,
                                                   lanes > 1, self.allocator.block_size, wide,
                                                   common),
                          grid,
                          paged + (self._order, self._final_start, self._merge_ptr,
                                   self._common, self.partial_out, self.partial_lse, "out")
                          + scalars + (self.num_branches, lanes,
                                       int(self.arrays.final_heads_first))))
        return templates

    def _pool_args(self, spec, paged: tuple) -> tuple:
        """``paged`` with each pool ``spec`` reads through a TMA descriptor as a
        :class:`TensorMap` of [slots, KV heads x head_dim]."""
        pool = self.allocator.k_pools[0]
        rows, cols = pool.shape[0] * pool.shape[1], pool.shape[2] * pool.shape[3]
        names = specializations.FAMILIES[spec.family].param_names
        return tuple(TensorMap(arg, rows, cols) if name in spec.tensor_maps else arg
                     for name, arg in zip(names, paged))

    def _partial_spec(self, dtype: str, block_m: int, max_tokens: int, programs: int):
        """The partial launch of the ``block_m``-row tile: its kernel reads each range through
        the pages or as the runs of slots the plan found (:attr:`contiguous`)."""
        runs = self.contiguous.get(block_m, 0)
        config = self._config("tree_partial", dtype, max_tokens, programs, block_m, runs)
        return dispatch.tree_partial_spec(dtype, self.head_dim, block_m, self.arch, config,
                                          self.allocator.block_size, runs)

    def _decode_template(self, dtype: str, grid: tuple, longest: int, paged: tuple) -> tuple:
        """A plan with no partials (``PlanArrays.as_paged_decode``): paged_decode's kernel, unsplit,
        over the final launch's ``grid`` (one lane: a program per branch and query tile), each
        program a whole branch (up to its table's capacity, so the plan survives growth); the
        config by the longest branch now."""
        spec = dispatch.decode_spec(dtype, self.head_dim, False, self.arch, self._config(
            "paged_decode", dtype, longest, math.prod(grid)), self.allocator.block_size)
        max_blocks = self.tables.shape[1]
        scalars = decode_scalars(spec, self.sm_scale, self.num_qo_heads,
                                 self.allocator.num_kv_heads, self.allocator.block_size,
                                 max_blocks, max_blocks * self.allocator.block_size)
        return spec, grid, paged + ("out", None, None) + scalars

    def _config(self, kernel: str, dtype: str, max_tokens: int, programs: int,
                block_m: int | None = None, contiguous: int = 0) -> tuple[int, int, int]:
        """The dispatch rules' config for a launch of ``programs`` programs that walk at most
        ``max_tokens`` tokens each."""
        config = dispatch.config_for(kernel, dtype, self.head_dim, self.arch, max_tokens, block_m,
                                     programs, self.num_sms, contiguous)
        if log.enabled():
            log.config_chosen(kernel, config, dtype, self.arch, self.head_dim, max_tokens,
                              block_m, programs=programs, num_sms=self.num_sms,
                              slot_runs=contiguous)
        return config

    def _upload_work_lists(self, device: torch.device) -> None:
        """One host-to-device copy of every int32 list, packed by the planner (each pointer
        valid, distinct and 16-byte aligned); views of it for the launches."""
        arrays = self.arrays
        parts = [arrays.order, arrays.final_start, arrays.merge_ptr, arrays.entry_slot,
                 arrays.common, *arrays.items.values()]
        self._work = torch.tensor(arrays.work, device=device)  # a copy on the CPU too
        (self._order, self._final_start, self._merge_ptr, self._entry_slot, self._common,
         *self._items) = [self._work[o:o + p.size] for p, o in zip(parts, arrays.work_offsets)]

    def _quick_check(self, q, layer, out) -> bool:
        """Whether a CUDA plan's ``run`` arguments certainly pass :meth:`_validate`: the same
        conditions as identity and integer compares, with no message to build (H100 host:
        2.8 against 3.3 us, per layer and step). False sends them to the full check."""
        index = self._cuda_index
        return (index is not None and type(layer) is int
                and 0 <= layer < self.allocator.num_layers
                and self._fits(q, index) and (out is None or self._fits(out, index)))

    def _fits(self, t, index: int) -> bool:
        return (type(t) is torch.Tensor and t.dtype is self.allocator.dtype and t.is_cuda
                and t.get_device() == index and t.shape == self._io_shape
                and t.is_contiguous() and not t.data_ptr() % POINTER_ALIGN)

    def _validate(self, q, layer, out) -> None:
        for name, t in (("q", q), ("out", out)):
            if t is None:  # out only
                continue
            check_tensor(name, t, self.allocator.dtype, self.allocator.device, "the allocator")
            if tuple(t.shape) != self._io_shape:
                raise ValueError(f"{name} must be [num_branches, num_qo_heads, head_dim] = "
                                 f"{self._io_shape}, got {tuple(t.shape)}")
        check_layer(layer, self.allocator.num_layers)


_plans: "weakref.WeakKeyDictionary[PhysicalKVAllocator, tuple]" = weakref.WeakKeyDictionary()


def tree_attention(q: torch.Tensor, allocator: PhysicalKVAllocator, branch_ids: Sequence[int],
                   layer: int = 0, out: torch.Tensor | None = None,
                   sm_scale: float | None = None) -> torch.Tensor:
    """Decode attention of one query token per branch over its whole path in ``allocator``:
    ``q`` is ``[len(branch_ids), num_qo_heads, head_dim]``; returns the same shape in q's
    dtype. Shared tokens are read once for all the branches below them.

    Keeps the last plan per allocator and reuses it while the branches, their tree and the
    head count are unchanged (the layers of one step, and steps that only append). Engines
    that want to control planning use :class:`TreeAttentionPlan` directly.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_branches, num_qo_heads, head_dim], got "
                         f"{tuple(q.shape)}")
    ids = np.asarray(branch_ids)
    cached = _plans.get(allocator) if isinstance(allocator, PhysicalKVAllocator) else None
    if cached is not None and cached[0] == (q.shape[1], sm_scale) and _same_ids(cached[1], ids) \
            and cached[1].tree_version == allocator.tree_version:
        try:
            return cached[1].run(q, layer, out)
        except StalePlan:  # the branches outgrew its tables: plan again
            pass
    plan = TreeAttentionPlan(allocator, ids, q.shape[1], sm_scale)
    out = plan.run(q, layer, out)
    _plans[allocator] = ((q.shape[1], sm_scale), plan)  # only a plan that ran is kept
    return out


def ordered_grid(programs: int, heads: int, heads_first: bool) -> tuple[int, int, int]:
    """A tree launch's grid: (programs, heads), or (heads, programs) where each program's heads
    run together (``tree_partial``'s items by ``PlanArrays.heads_first``, packed ``tree_final``
    programs by ``PlanArrays.final_heads_first``; the kernels' ``item_and_head``)."""
    return (heads, programs, 1) if heads_first else (programs, heads, 1)


def _longest_item(records: np.ndarray) -> int:
    """The most tokens one ``tree_partial`` work item walks."""
    fields = specializations.TREE_ITEM_FIELDS
    lengths = records[:, fields.index("kv_end")] - records[:, fields.index("kv_start")]
    return int(lengths.max(initial=0))


def _same_ids(plan: TreeAttentionPlan, ids: np.ndarray) -> bool:
    """Whether ``ids`` are the plan's branches, in order (vectorised: no loop per branch)."""
    return ids.dtype.kind in "iu" and ids.shape == plan.branch_ids.shape and \
        bool((ids == plan.branch_ids).all())


def _check_heads(num_qo_heads, num_kv_heads: int) -> int:
    num_qo_heads = as_int("num_qo_heads", num_qo_heads, low=1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads must be a positive multiple of the allocator's "
                         f"num_kv_heads ({num_kv_heads}), got {num_qo_heads}")
    return num_qo_heads
