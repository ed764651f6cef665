"""Kernel names, parameter lists and specialization keys: the one place they are made.

The AOT build (``aot/build.py``) compiles a :class:`Spec` under the name :attr:`Spec.name`
with the signature :meth:`Spec.signature`; the manifest records both; dispatch builds the same
``Spec`` for a call and launches it by name. Nothing here imports triton.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

#: torch dtype name -> Triton's name for it in signatures and kernel names.
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}

#: What follows each tensor-map parameter in a compiled kernel's parameter list (Triton's host
#: descriptors on sm90): the view's shape, then its strides, in elements.
TENSOR_MAP_FIELDS = (("rows", "i32"), ("cols", "i32"), ("row_stride", "i64"),
                     ("col_stride", "i64"))

#: Triton appends these two pointer parameters to every compiled kernel; the launcher
#: passes null for both (the build rejects kernels that need scratch memory).
SCRATCH_PARAMS = (("global_scratch", "*i8"), ("profile_scratch", "*i8"))


@dataclass(frozen=True)
class Family:
    """One ``@triton.jit`` kernel: its runtime parameters (in order) and its constexprs.

    A parameter type ``"*{dt}"`` is filled with the specialization's dtype. ``tensor_maps``: the
    pointer parameters a specialization with constexpr ``TMA`` 1 takes as TMA descriptors instead
    (Triton's host tensor descriptors: :meth:`Spec.signature`, :meth:`Spec.runtime_params`), each
    a 2-D row-major view read in tiles of the constexprs ``tensor_map_tile`` names (rows, columns).
    ``waits_for_previous``:
    compiled with grid dependency control (constexpr ``PDL`` 1), the kernel waits for the
    launch before it before reading anything that launch wrote and before it ends, so it may be
    launched to overlap it (programmatic dependent launch), and a launch that waits for it has
    waited for every launch before it too.
    """
    name: str
    params: tuple[tuple[str, str], ...]
    constexprs: tuple[str, ...]
    waits_for_previous: bool = False
    tensor_maps: tuple[str, ...] = ()
    tensor_map_tile: tuple[str, str] = ("", "")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.params)


PAGED_DECODE = Family(
    name="paged_decode",
    params=(
        ("q", "*{dt}"), ("k_pool", "*{dt}"), ("v_pool", "*{dt}"),
        ("block_tables", "*i32"), ("seq_lens", "*i32"),
        ("out", "*{dt}"), ("partial_out", "*fp32"), ("partial_lse", "*fp32"),
        ("sm_scale_log2", "fp32"), ("num_qo_heads", "i32"), ("num_kv_heads", "i32"),
        ("page_size", "i32"), ("max_blocks", "i32"), ("tokens_per_split", "i32"),
    ),
    constexprs=("HEAD_DIM", "BLOCK_M", "BLOCK_N", "SPLIT", "PAGE"),
)

MERGE_SPLITS = Family(
    name="merge_splits",
    params=(("partial_out", "*fp32"), ("partial_lse", "*fp32"), ("out", "*{dt}"),
            ("num_splits", "i32")),
    constexprs=("HEAD_DIM", "BLOCK_S"),
)

# K/V are copied as 16-bit words, so one kernel serves fp16 and bf16 pools.
APPEND_KV = Family(
    name="append_kv",
    params=(("k_pool", "*i16"), ("v_pool", "*i16"), ("slots", "*i64"),
            ("k_new", "*i16"), ("v_new", "*i16"), ("row_elems", "i32")),
    constexprs=("BLOCK",),
)

#: One work item of ``tree_partial``: an int32 record of these fields, in this order (the
#: planner writes them, the kernel reads them by index). ``open_end`` 1: the item ends at its
#: table row's current length, read on the device (a final range's last chunk). ``run_split``:
#: where the second run of consecutive slots of the item's range begins, read by the kernels
#: that take the range as two runs (``planner.item_runs`` writes it; the planner writes
#: ``kv_end``).
TREE_ITEM_FIELDS = ("table_row", "kv_start", "kv_end", "row_ptr", "num_rows",
                    "first_flat_row", "entry0", "open_end", "run_split")

#: A packed final program's shared range: an int32 record of these fields (the planner writes
#: them, one per program; ``tree_final`` with ``COMMON`` reads them): tokens [start, end) that
#: every lane of the program reads in the same pages, through row ``lead_row``'s block table.
COMMON_FIELDS = ("lead_row", "start", "end")

#: A query tile: an int32 record of these fields (the planner writes one per tile,
#: ``tree_queries`` reads them): rows ``first_row`` to ``first_row + rows - 1`` of a plan, in
#: lanes of ``lane_rows`` consecutive queries of one sequence, each lane read through the block
#: table of its longest row, the lanes' first ``shared`` tokens (the same slots) once for all
#: (2^31 - 1 in a tile of one lane: all its tokens).
QUERY_TILE_FIELDS = ("first_row", "rows", "lane_rows", "shared")

_TREE_PAGED = (("q", "*{dt}"), ("k_pool", "*{dt}"), ("v_pool", "*{dt}"),
               ("block_tables", "*i32"), ("seq_lens", "*i32"))
_TREE_SCALARS = (("sm_scale_log2", "fp32"), ("num_qo_heads", "i32"), ("num_kv_heads", "i32"),
                 ("page_size", "i32"), ("max_blocks", "i32"))

TREE_PARTIAL = Family(
    name="tree_partial",
    params=_TREE_PAGED + (("order", "*i32"), ("items", "*i32"), ("entry_slot", "*i32"),
                          ("partial_out", "*fp32"), ("partial_lse", "*fp32")) + _TREE_SCALARS
    + (("early_final", "i32"), ("heads_first", "i32")),
    constexprs=("HEAD_DIM", "BLOCK_M", "BLOCK_N", "PAGE", "SLOT_RUNS", "TMA", "PDL"),
    waits_for_previous=True,  # a second partial launch overlaps the first (one per row tile)
    # TMA (slot-run items only): the pools as [slots, kv_heads * head_dim], a token tile per load
    tensor_maps=("k_pool", "v_pool"),
    tensor_map_tile=("BLOCK_N", "HEAD_DIM"),
)

TREE_FINAL = Family(
    name="tree_final",
    params=_TREE_PAGED + (("order", "*i32"), ("final_start", "*i32"), ("merge_ptr", "*i32"),
                          ("common", "*i32"), ("draft_masks", "*i64"), ("partial_out", "*fp32"),
                          ("partial_lse", "*fp32"), ("out", "*{dt}")) + _TREE_SCALARS
    + (("num_rows", "i32"), ("lanes", "i32"), ("heads_first", "i32")),
    constexprs=("HEAD_DIM", "BLOCK_M", "BLOCK_N", "PACKED", "COMMON", "DRAFT", "PAGE", "PDL"),
    waits_for_previous=True,
)

TREE_MERGE = Family(
    name="tree_merge",
    params=(("merge_ptr", "*i32"), ("partial_out", "*fp32"), ("partial_lse", "*fp32"),
            ("out", "*{dt}"), ("num_qo_heads", "i32")),
    constexprs=("HEAD_DIM", "BLOCK_S", "PDL"),
    waits_for_previous=True,
)

TREE_QUERIES = Family(
    name="tree_queries",
    params=_TREE_PAGED + (("k_tiles", "*{dt}"), ("v_tiles", "*{dt}"), ("query_tiles", "*i32"),
                          ("draft_masks", "*i64"), ("out", "*{dt}")) + _TREE_SCALARS,
    constexprs=("HEAD_DIM", "BLOCK_M", "BLOCK_N", "DRAFT", "LANES", "TMA", "PAGE"),
    # TMA: the pools again, as [slots, kv_heads * head_dim] (a token tile per load), for the
    # run of slots read first; the paged walk after it reads k_pool and v_pool.
    tensor_maps=("k_tiles", "v_tiles"),
    tensor_map_tile=("BLOCK_N", "HEAD_DIM"),
)

FAMILIES = {f.name: f for f in (PAGED_DECODE, MERGE_SPLITS, APPEND_KV, TREE_PARTIAL,
                                TREE_FINAL, TREE_MERGE, TREE_QUERIES)}


@dataclass(frozen=True)
class Spec:
    """A compiled specialization: family + dtype + constexpr values + launch config."""
    family: str
    dtype: str | None          # "float16" | "bfloat16" | None (dtype-free kernels)
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    @functools.cached_property  # launched by name every call: build the string once
    def name(self) -> str:
        parts = [self.family]
        if self.dtype is not None:
            parts.append(DTYPES[self.dtype])
        parts += [f"{k.lower()}{v}" for k, v in self.constexprs]
        parts += [f"w{self.num_warps}", f"s{self.num_stages}"]
        return "_".join(parts)

    @property
    def overlaps_previous(self) -> bool:
        """Whether a launch of this kernel may overlap the launch before it (the manifest's
        ``overlaps_previous``: the launcher asks for programmatic dependent launch)."""
        return FAMILIES[self.family].waits_for_previous and dict(self.constexprs)["PDL"] == 1

    @property
    def key(self) -> dict:
        """What the manifest records and dispatch matches on."""
        return {"dtype": self.dtype, **dict(self.constexprs),
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @property
    def tensor_maps(self) -> tuple[str, ...]:
        """The parameters this specialization reads through TMA descriptors (none unless its
        constexpr ``TMA`` is 1)."""
        family = FAMILIES[self.family]
        return family.tensor_maps if dict(self.constexprs).get("TMA") else ()

    def tensor_map_tile(self) -> tuple[int, int]:
        """(rows, columns) of the tile each descriptor load reads."""
        constexprs = dict(self.constexprs)
        return tuple(constexprs[name] for name in FAMILIES[self.family].tensor_map_tile)

    def signature(self) -> dict[str, str]:
        """Triton signature: runtime params with types, then constexprs."""
        family = FAMILIES[self.family]
        dt = DTYPES.get(self.dtype, "")
        sig = {name: typ.format(dt=dt) for name, typ in family.params}
        for name in self.tensor_maps:
            rows, cols = self.tensor_map_tile()
            sig[name] = f"tensordesc<{dt}[{rows}, {cols}]>"
        sig.update({name: "constexpr" for name in family.constexprs})
        return sig

    def runtime_params(self) -> list[tuple[str, str]]:
        """The compiled kernel's parameters (name, manifest type), before Triton's scratch
        pointers: the family's, each tensor map as ``nvTmaDesc`` followed by its
        :data:`TENSOR_MAP_FIELDS` (named ``<param>_<field>``)."""
        params = []
        for name, typ in self.signature().items():
            if typ == "constexpr":
                continue
            if name not in self.tensor_maps:
                params.append((name, typ))
                continue
            params.append((name, "nvTmaDesc"))
            params += [(f"{name}_{field}", ftyp) for field, ftyp in TENSOR_MAP_FIELDS]
        return params


def make_spec(family: Family, dtype: str | None, num_warps: int, num_stages: int,
              **constexprs: int) -> Spec:
    """Build a Spec, checking that exactly the family's constexprs are given."""
    if set(constexprs) != set(family.constexprs):
        raise ValueError(f"{family.name} takes constexprs {family.constexprs}, "
                         f"got {tuple(constexprs)}")
    typed = any("{dt}" in typ for _, typ in family.params)
    if typed and dtype not in DTYPES:
        raise ValueError(f"{family.name}: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if not typed and dtype is not None:
        raise ValueError(f"{family.name} has no dtype; got {dtype!r}")
    ordered = tuple((k, int(constexprs[k])) for k in family.constexprs)
    return Spec(family.name, dtype, ordered, num_warps, num_stages)
