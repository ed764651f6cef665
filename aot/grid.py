"""Which specializations are compiled for each arch.

The grid is what dispatch can ask for (``flash_reasoning.dispatch.required_specs``), plus,
with ``FLASH_REASONING_AOT_GRID=wide``, the candidate configs a tuning run measures.
"""
from __future__ import annotations

import os

from flash_reasoning import dispatch
from flash_reasoning.specializations import (DTYPES, PAGED_DECODE, TREE_FINAL, TREE_PARTIAL, Spec,
                                            make_spec)

ARCHS = ("sm80", "sm89", "sm90")

#: (BLOCK_N, num_warps, num_stages) candidates measured by a tuning run.
DECODE_CANDIDATES = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (64, 8, 2))
#: Tree kernel candidates (BLOCK_N, num_warps, num_stages), fp16 head_dim 128 for now: the
#: wide partial tile and the final kernel.
TREE_PARTIAL_CANDIDATES = ((32, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2))
TREE_FINAL_CANDIDATES = ((64, 4, 1), (64, 4, 2), (32, 4, 2), (64, 8, 2))


def specs_for(arch: str, wide: bool | None = None) -> list[Spec]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; the grid covers {ARCHS}")
    if wide is None:
        wide = os.environ.get("FLASH_REASONING_AOT_GRID", "") == "wide"
    specs = dict.fromkeys(dispatch.required_specs(arch))
    if wide:
        specs.update(dict.fromkeys(_decode_candidates() + _tree_candidates()))
    return list(specs)


def _tree_candidates() -> list[Spec]:
    partial = [make_spec(TREE_PARTIAL, "float16", w, s, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=n)
               for n, w, s in TREE_PARTIAL_CANDIDATES]
    final = [make_spec(TREE_FINAL, "float16", w, s, HEAD_DIM=128, BLOCK_M=dispatch.BLOCK_M,
                       BLOCK_N=n) for n, w, s in TREE_FINAL_CANDIDATES]
    return partial + final


def _decode_candidates() -> list[Spec]:
    # head_dim 256 keeps its one config: its larger tiles overflow shared memory in several
    # (128/8/3 needs 274 KB on sm90, which allows 227 KB).
    return [make_spec(PAGED_DECODE, dtype, warps, stages, HEAD_DIM=head_dim,
                      BLOCK_M=dispatch.BLOCK_M, BLOCK_N=block_n, SPLIT=split)
            for dtype in DTYPES for head_dim in (64, 128) for split in (0, 1)
            for block_n, warps, stages in DECODE_CANDIDATES]
