"""Benchmarks over the cases file: each case's tree, timed on the GPU beside its floor.

The floor of a case is its unique bytes (KV stored once, q, out) over the measured copy
bandwidth. ``paged_decode`` does not share: it reads each branch's whole path (logical
tokens), which is what an engine without prefix sharing does.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from . import reference, timing
from .allocator import PhysicalKVAllocator
from .ops.paged_decode import paged_decode
from .ops.tree_attention import TreeAttentionPlan
from .synthetic import paged_problem, random_kv
from .tree import build_branches, from_levels


def load_cases(path: str | Path | None = None) -> dict:
    """The cases file (default: the copy shipped with the package)."""
    if path is None:
        return json.loads(resources.files("flash_reasoning").joinpath("data/cases.json")
                          .read_text())
    return json.loads(Path(path).read_text())


@dataclass
class Row:
    case: str
    op: str
    us: float
    floor_us: float
    read_bytes: int
    fasttree_us: float | None = None
    sdpa_us: float | None = None
    error: float | None = None     # relative error against an independent computation

    @property
    def over_floor(self) -> float:
        return self.us / self.floor_us

    @property
    def achieved_tbps(self) -> float:
        return self.read_bytes / (self.us * 1e-6) / 1e12


def _bytes_per_token(case: dict) -> int:
    return 2 * case["num_kv_heads"] * case["head_dim"] * torch.finfo(_dtype(case)).bits // 8


def _dtype(case: dict) -> torch.dtype:
    return getattr(torch, case["dtype"])


def unique_bytes(case: dict) -> int:
    """KV stored once, plus q and out: what the floor is made of."""
    qo = 2 * case["branches"] * case["num_qo_heads"] * case["head_dim"] * 2
    return case["unique_tokens"] * _bytes_per_token(case) + qo


def branch_lengths(case: dict) -> list[int]:
    """Each leaf's full path length: all of a level's nodes have that level's length."""
    return [sum(case["tokens_per_level"])] * case["branches"]


def bench_paged_decode(case: dict, bandwidth_tbps: float, runs: int = 100,
                       block_size: int = 16) -> Row:
    """``paged_decode`` over each branch's own copy of its path (no sharing)."""
    problem = paged_problem(branch_lengths(case), case["num_qo_heads"], case["num_kv_heads"],
                            case["head_dim"], block_size, _dtype(case), "cuda")
    out = torch.empty_like(problem.q)
    us = timing.median_us(lambda: paged_decode(problem.q, problem.k_pool, problem.v_pool,
                                               problem.block_tables, problem.seq_lens,
                                               out=out), runs)
    logical = case["logical_tokens"] * _bytes_per_token(case)
    floor = unique_bytes(case) / (bandwidth_tbps * 1e12) * 1e6
    return Row(case["name"], "paged_decode", us, floor, logical,
               case.get("h100_fasttree_us"), case.get("h100_linear_sdpa_us"))


def case_allocator(case: dict, device: str = "cuda", block_size: int = 16,
                   seed: int = 0) -> tuple[PhysicalKVAllocator, list[int]]:
    """The case's tree in a fresh allocator, random K/V in every node; returns the leaves."""
    spec = from_levels(case["nodes_per_level"], case["tokens_per_level"])
    blocks = int((-(-spec.seqlen // block_size) + 1).sum()) + 1
    alloc = PhysicalKVAllocator(blocks, block_size, case["num_kv_heads"], case["head_dim"],
                                dtype=_dtype(case), device=device)
    gen = torch.Generator().manual_seed(seed)
    leaves = build_branches(alloc, spec, lambda node, layer, n: random_kv(alloc, gen, n))
    return alloc, leaves


def bench_tree_attention(case: dict, bandwidth_tbps: float, runs: int = 100,
                         target_chunk: int | None = None) -> Row:
    """``TreeAttentionPlan.run`` on the case's shared tree; checked against ``paged_decode``
    over the same allocator's tables (an independent kernel) before timing."""
    alloc, leaves = case_allocator(case)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"], generator=gen)
    q = q.to(_dtype(case)).cuda()
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], target_chunk=target_chunk)
    out = torch.full_like(q, float("nan"))
    plan.run(q, 0, out)
    tables, lengths = alloc.block_tables(leaves)
    check = paged_decode(q, alloc.k_pools[0], alloc.v_pools[0], tables, lengths)
    error = reference.relative_error(out, check)
    us = timing.median_us(lambda: plan.run(q, 0, out), runs)
    floor = unique_bytes(case) / (bandwidth_tbps * 1e12) * 1e6
    return Row(case["name"], "tree_attention", us, floor, unique_bytes(case),
               case.get("h100_fasttree_us"), case.get("h100_linear_sdpa_us"), error)


def format_rows(rows: list[Row]) -> str:
    head = (f"{'case':24} {'op':14} {'time us':>9} {'floor us':>9} {'x floor':>8} "
            f"{'read TB/s':>9} {'FastTree':>9} {'SDPA':>8} {'rel err':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:24} {r.op:14} {r.us:9.1f} {r.floor_us:9.1f} "
                     f"{r.over_floor:8.2f} {r.achieved_tbps:9.2f} {_opt(r.fasttree_us):>9} "
                     f"{_opt(r.sdpa_us):>8} {_err(r.error):>8}")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """The issue's targets: geometric means of time/floor per head layout, worst case."""
    lines = []
    for layout, limit in (("q32kv8", 10.0), ("q32kv32", 10.0), ("q16kv1", 0.0)):
        picked = [r for r in rows if r.op == "tree_attention" and r.case.endswith(layout)
                  and r.floor_us >= limit]
        if picked:
            geo = math.exp(sum(math.log(r.over_floor) for r in picked) / len(picked))
            worst = max(picked, key=lambda r: r.over_floor)
            lines.append(f"tree_attention {layout} (floor >= {limit:g} us): geomean "
                         f"{geo:.2f}x floor over {len(picked)} cases, worst {worst.case} "
                         f"{worst.over_floor:.2f}x")
    small = [r for r in rows if r.op == "tree_attention" and r.floor_us < 10]
    if small:
        worst = max(small, key=lambda r: r.us)
        lines.append(f"tree_attention small cases (floor < 10 us): slowest {worst.case} "
                     f"{worst.us:.1f} us")
    return "\n".join(lines)


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _opt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.1f}"
