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

from . import timing
from .ops.paged_decode import paged_decode
from .synthetic import paged_problem


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


def format_rows(rows: list[Row]) -> str:
    head = (f"{'case':24} {'op':13} {'time us':>9} {'floor us':>9} {'x floor':>8} "
            f"{'read TB/s':>9} {'FastTree':>9} {'SDPA':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:24} {r.op:13} {r.us:9.1f} {r.floor_us:9.1f} "
                     f"{r.over_floor:8.2f} {r.achieved_tbps:9.2f} {_opt(r.fasttree_us):>9} "
                     f"{_opt(r.sdpa_us):>8}")
    return "\n".join(lines)


def _opt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.1f}"
