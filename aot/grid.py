"""Which specializations are compiled for each arch.

The grid is what dispatch can ask for (``flash_reasoning.dispatch.required_specs``), plus,
with ``FLASH_REASONING_AOT_GRID=wide``, the candidate configs a tuning run measures.
"""
from __future__ import annotations

import os

from flash_reasoning import dispatch
from flash_reasoning.specializations import DTYPES, Spec

ARCHS = ("sm80", "sm89", "sm90")

#: (BLOCK_N, num_warps, num_stages) candidates a tuning run measures
#: (``flash_reasoning.tools.tune``) for the decode-tile kernels (paged_decode, split or not,
#: tree_final, packed or not, the narrow tree_partial) and for the wide tree_partial tile.
DECODE_TILE_CANDIDATES = ((16, 2, 1), (32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3),
                          (128, 4, 2), (64, 8, 2))
WIDE_TILE_CANDIDATES = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3),
                        (128, 8, 2))
#: Every head_dim; a candidate whose tiles overflow an arch's shared memory is left out
#: (:func:`fits_shared_memory`).
CANDIDATE_HEAD_DIMS = (64, 128, 256)
#: Opt-in shared memory per block (bytes) of each arch: the candidates' estimate must fit, and
#: the build refuses a compiled kernel above it (it could not launch there).
MAX_SHARED = {"sm80": 163 << 10, "sm89": 99 << 10, "sm90": 227 << 10}


def specs_for(arch: str, wide: bool | None = None) -> list[Spec]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; the grid covers {ARCHS}")
    if wide is None:
        wide = os.environ.get("FLASH_REASONING_AOT_GRID", "") == "wide"
    specs = dict.fromkeys(dispatch.required_specs(arch))
    if wide:
        specs.update(dict.fromkeys(candidate_specs(arch)))
    return list(specs)


def candidate_specs(arch: str) -> list[Spec]:
    """Every candidate of every rule list that fits the arch's shared memory, for each of its
    kernel's addressings (any page size, each compiled one, one run of slots): a tuning run
    times the kernels a call would launch."""
    specs = []
    for dtype in DTYPES:
        for head_dim in CANDIDATE_HEAD_DIMS:
            for kernel, block_m in dispatch.RULE_LISTS:
                wide_tile = block_m is not None and block_m != dispatch.BLOCK_M
                rows = block_m or dispatch.RULE_LIST_SPECS[kernel][1].get("BLOCK_M",
                                                                          dispatch.BLOCK_M)
                for config in WIDE_TILE_CANDIDATES if wide_tile else DECODE_TILE_CANDIDATES:
                    if fits_shared_memory(arch, head_dim, rows, config) and \
                            serves_every_lane(kernel, rows, config):
                        specs += [dispatch.kernel_spec(kernel, dtype, head_dim, arch, config,
                                                       block_m, page_size, slot_runs)
                                  for page_size, slot_runs in dispatch.addressings(kernel)]
    return specs


def serves_every_lane(kernel: str, rows: int, config: tuple[int, int, int]) -> bool:
    """A packed final program's KV tile holds a token of each lane at least (one lane per row
    at GQA group 1): BLOCK_N >= its rows."""
    return not dispatch.RULE_LIST_SPECS[kernel][1].get("PACKED") or config[0] >= rows


def fits_shared_memory(arch: str, head_dim: int, block_m: int,
                       config: tuple[int, int, int]) -> bool:
    """Whether the K and V tiles of every stage, and the query tile, fit (16-bit elements)."""
    block_n, _, stages = config
    need = (2 * stages * block_n + block_m) * head_dim * 2
    return need <= MAX_SHARED[arch]
