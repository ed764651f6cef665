"""Benchmarks over the seed's table and the cases file: each case's tree, three ways.

Per case one allocator holds the tree (each shared token stored once). ``tree_attention``
runs over it; ``paged_decode`` and torch SDPA run over a materialised copy in which every
branch owns its whole path (what an engine without prefix sharing stores and reads). The
floor of a case is its unique bytes (KV stored once, q, out) over the measured copy
bandwidth; its roofline, the larger of the floor and its attention FLOPs over the measured
dense matrix-multiply rate, plus one launch (all three measured in the run: ``Machine``). On
the GPU times are CUDA-event medians with the L2 flushed before each run; on
CPU (``device="cpu"``, the PyTorch path) they are host-time medians, for the table's shape
only.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import reference
from ..allocator import PhysicalKVAllocator
from ..ops.paged_decode import paged_decode
from ..ops.tree_attention import TreeAttentionPlan
from . import timing
from .synthetic import random_kv
from .trees import TreeSpec, build_branches, from_levels

OPS = ("tree_attention", "paged_decode", "sdpa")
#: The seed's table: a shared prompt, one short branch per batch entry.
SEED_BATCHES = (1, 16, 64, 128, 256)
SEED_PREFIX, SEED_LEAF = 2048, 64
#: The CPU version of the table: the same shape, small enough for the PyTorch path.
CPU_SEED = dict(batches=(1, 4, 16), prefix=256, leaf=16)
#: Materialised copies above this are skipped (K and V of ft_1,1024/q32kv32 take 35 GB;
#: the H100 holds 80).
MAX_MATERIALISED_BYTES = 40 << 30


def load_cases(path: str | Path | None = None) -> dict:
    """The cases file (default: the copy shipped with the package)."""
    if path is None:
        return json.loads(resources.files("flash_reasoning").joinpath("data/cases.json")
                          .read_text())
    return json.loads(Path(path).read_text())


def level_case(name: str, nodes_per_level: Sequence[int], tokens_per_level: Sequence[int],
               num_qo_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
               dtype: str = "float16") -> dict:
    """A tree in the cases file's format: level ``i`` holds ``nodes_per_level[i]`` nodes of
    ``tokens_per_level[i]`` tokens, every leaf a branch whose path crosses each level once."""
    branches = nodes_per_level[-1]
    return {"name": name, "nodes_per_level": list(nodes_per_level),
            "tokens_per_level": list(tokens_per_level), "num_qo_heads": num_qo_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype,
            "branches": branches,
            "unique_tokens": sum(n * t for n, t in zip(nodes_per_level, tokens_per_level)),
            "logical_tokens": branches * sum(tokens_per_level)}


def seed_case(batch: int, prefix: int = SEED_PREFIX, leaf: int = SEED_LEAF,
              num_qo_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
              dtype: str = "float16") -> dict:
    """One row of the seed's table as a case (the cases file's format)."""
    return level_case(f"seed_b{batch}/q{num_qo_heads}kv{num_kv_heads}", [1, batch],
                      [prefix, leaf], num_qo_heads, num_kv_heads, head_dim, dtype)


def table_cases(cases_file: dict | None, cpu: bool) -> list[dict]:
    """The seed's table first (with the file's reference times where it has the case), then
    the file's other cases; on CPU the small seed table only."""
    if cpu:
        return [seed_case(b, CPU_SEED["prefix"], CPU_SEED["leaf"]) for b in CPU_SEED["batches"]]
    by_name = {c["name"]: c for c in (cases_file or {}).get("cases", [])}
    seeds = [{**seed_case(b), **by_name.get(seed_case(b)["name"], {})} for b in SEED_BATCHES]
    names = {c["name"] for c in seeds}
    return seeds + [c for c in by_name.values() if c["name"] not in names]


@dataclass
class Row:
    case: str
    op: str
    device: str                    # "gpu" or "cpu": what the time means
    us: float | None               # None: skipped (too large to materialise)
    floor_us: float | None         # GPU only
    unique_bytes: int
    logical_bytes: int
    kv_bytes: int                  # KV memory the op reads from
    kv_separate_bytes: int         # ... had every branch stored its own path
    error: float | None = None     # relative error against the float64 reference
    speedup: float | None = None   # paged_decode's time over this op's, same case
    fasttree_us: float | None = None
    sdpa_ref_us: float | None = None
    roofline_us: float | None = None  # GPU only (absent from runs before the roofline)

    @property
    def over_floor(self) -> float | None:
        return None if self.us is None or self.floor_us is None else self.us / self.floor_us

    @property
    def over_roofline(self) -> float | None:
        return None if self.us is None or self.roofline_us is None else self.us / self.roofline_us

    def tbps(self, nbytes: int) -> float | None:
        """Bytes per GPU time; ``None`` on CPU (host times of the PyTorch path)."""
        if self.us is None or self.device == "cpu":
            return None
        return nbytes / (self.us * 1e-6) / 1e12

    def to_dict(self) -> dict:
        return {**asdict(self), "over_floor": self.over_floor,
                "over_roofline": self.over_roofline,
                "unique_tbps": self.tbps(self.unique_bytes),
                "logical_tbps": self.tbps(self.logical_bytes)}


def dtype_of(case: dict) -> torch.dtype:
    return getattr(torch, case["dtype"])


def bytes_per_token(case: dict) -> int:
    return 2 * case["num_kv_heads"] * case["head_dim"] * torch.finfo(dtype_of(case)).bits // 8


def unique_bytes(case: dict) -> int:
    """KV stored once, plus q and out: what the floor is made of."""
    qo = 2 * case["branches"] * case["num_qo_heads"] * case["head_dim"] * 2
    return case["unique_tokens"] * bytes_per_token(case) + qo


def floor_us(case: dict, bandwidth_tbps: float) -> float:
    """The case's floor: its unique bytes moved once at ``bandwidth_tbps``."""
    return unique_bytes(case) / (bandwidth_tbps * 1e12) * 1e6


def attention_flops(case: dict) -> int:
    """QK^T and PV: 2 x head_dim multiply-adds per (query head, KV token it attends); each
    branch's query heads attend its whole path (the logical tokens)."""
    return 4 * case["head_dim"] * case["num_qo_heads"] * case["logical_tokens"]


@dataclass(frozen=True)
class Machine:
    """What a run's rooflines are made of, measured once per run (``timing``)."""
    copy_bandwidth_tbps: float
    matmul_tflops: float
    launch_us: float


def roofline_us(case: dict, machine: Machine) -> float:
    """The case's roofline: its bytes at the copy bandwidth or its FLOPs at the matmul rate,
    whichever takes longer, plus one launch."""
    compute_us = attention_flops(case) / (machine.matmul_tflops * 1e12) * 1e6
    return max(floor_us(case, machine.copy_bandwidth_tbps), compute_us) + machine.launch_us


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def case_spec(case: dict) -> TreeSpec:
    """The case's tree: its ``parent``/``seqlen`` arrays (generated families), else its levels
    (the cases file)."""
    if "parent" in case:
        return TreeSpec(np.asarray(case["parent"]), np.asarray(case["seqlen"]))
    return from_levels(case["nodes_per_level"], case["tokens_per_level"])


def case_allocator(case: dict, device: str = "cuda", block_size: int = 16, seed: int = 0,
                   random: bool = True, spare_blocks: int = 0
                   ) -> tuple[PhysicalKVAllocator, list[int]]:
    """The case's tree in a fresh allocator, random K/V in every node (zeros, made on the
    device at once, when only timing matters: ``random=False``); returns the leaves. The pool
    holds ``spare_blocks`` free blocks beyond the tree's (for tokens added after)."""
    spec = case_spec(case)
    blocks = int((-(-spec.seqlen // block_size) + 1).sum()) + 1 + spare_blocks
    alloc = PhysicalKVAllocator(blocks, block_size, case["num_kv_heads"], case["head_dim"],
                                dtype=dtype_of(case), device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def fill(node, layer, n):
        if random:
            return random_kv(alloc, gen, n)
        zeros = torch.zeros(n, alloc.num_kv_heads, alloc.head_dim, dtype=alloc.dtype,
                            device=device)
        return zeros, zeros
    return alloc, build_branches(alloc, spec, fill)


@dataclass
class Separate:
    """Every branch's path copied out of the tree: ``k``/``v`` ``[n, max_len, kv_heads, d]``
    (dense per branch, so SDPA reads them as they are) and the block tables over them."""
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    block_size: int
    key_mask: torch.Tensor | None  # SDPA's mask where the branches' lengths differ

    @classmethod
    def from_tree(cls, alloc: PhysicalKVAllocator, leaves: list[int]) -> "Separate":
        tables, lengths = alloc.block_tables(leaves)
        n, blocks = tables.shape
        index = tables.long()
        shape = (n, blocks * alloc.block_size, alloc.num_kv_heads, alloc.head_dim)
        own = torch.arange(n * blocks, dtype=torch.int32, device=alloc.device).view(n, blocks)
        mask = None  # built here: a length read inside the timed call would sync the host
        if n and int(lengths.min()) != shape[1]:
            mask = torch.arange(shape[1], device=alloc.device) < lengths[:, None].long()
            mask = mask[:, None, None, :]
        return cls(alloc.k_pools[0][index].view(shape), alloc.v_pools[0][index].view(shape),
                   own, lengths, alloc.block_size, mask)

    def paged_decode(self, q, out):
        pool_shape = (-1, self.block_size, *self.k.shape[2:])
        return paged_decode(q, self.k.view(pool_shape), self.v.view(pool_shape), self.tables,
                            self.lengths, out=out)

    def sdpa(self, q, out):
        """torch SDPA of one query per branch over its dense path (a key mask when the
        branches' lengths differ)."""
        keys, values = self.k.transpose(1, 2), self.v.transpose(1, 2)
        result = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=self.key_mask,
            enable_gqa=q.shape[1] != keys.shape[1])
        out.copy_(result[:, :, 0, :])
        return out


def run_case(case: dict, ops: tuple[str, ...], device: str, runs: int,
             machine: Machine | None) -> list[Row]:
    """Every op of ``ops`` on one case: the rows, each checked before it is timed (floors and
    rooflines with ``machine``, the GPU's)."""
    alloc, leaves = case_allocator(case, device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"], generator=gen)
    q = q.to(dtype_of(case)).to(device)
    expected = reference.tree_attention(q, alloc, leaves) if _small(case) else None
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    report = alloc.memory_report()
    logical_bytes = case["logical_tokens"] * bytes_per_token(case)
    calls = {"tree_attention": lambda out: plan.run(q, 0, out)}
    separate = None
    if ops != ("tree_attention",) and report.bytes_separate <= MAX_MATERIALISED_BYTES:
        separate = Separate.from_tree(alloc, leaves)
        calls.update(paged_decode=lambda out: separate.paged_decode(q, out),
                     sdpa=lambda out: separate.sdpa(q, out))
    timer = _cpu_median_us if device == "cpu" else timing.median_us
    outputs = {op: calls[op](torch.full_like(q, float("nan"))) for op in ops if op in calls}
    rows = []
    for op in ops:
        row = Row(case["name"], op, "cpu" if device == "cpu" else "gpu", None,
                  None if machine is None else floor_us(case, machine.copy_bandwidth_tbps),
                  unique_bytes(case), logical_bytes,
                  report.bytes_used if op == "tree_attention" else report.bytes_separate,
                  report.bytes_separate, fasttree_us=case.get("h100_fasttree_us"),
                  sdpa_ref_us=case.get("h100_linear_sdpa_us"),
                  roofline_us=None if machine is None else roofline_us(case, machine))
        if op in outputs:
            row.error = _error(op, outputs, expected)
            out = torch.empty_like(q)
            row.us = timer(lambda: calls[op](out), runs)
        rows.append(row)
    _fill_speedups(rows)
    return rows


def _error(op: str, outputs: dict, expected: torch.Tensor | None) -> float | None:
    """Relative error against the float64 reference, or where that is too costly against
    the other kernel (tree_attention against paged_decode, the others against
    tree_attention). Outputs were poisoned with NaN first: a missed write is infinite."""
    if expected is None:
        other = "paged_decode" if op == "tree_attention" else "tree_attention"
        if other not in outputs:
            return None
        expected = outputs[other]
    return reference.relative_error(outputs[op], expected)


def _small(case: dict) -> bool:
    """Whether the float64 reference is cheap enough (it reads every branch's path)."""
    return case["logical_tokens"] * case["num_qo_heads"] <= 4_000_000


def _fill_speedups(rows: list[Row]) -> None:
    base = next((r.us for r in rows if r.op == "paged_decode" and r.us), None)
    for r in rows:
        r.speedup = None if base is None or r.us is None else base / r.us


def _cpu_median_us(fn, runs: int) -> float:
    times = []
    for _ in range(max(3, min(runs, 20))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


COLUMNS = (  # header, width, value of a row
    ("case", 34, lambda r: r.case), ("op", 14, lambda r: r.op), ("on", 3, lambda r: r.device),
    ("time us", 9, lambda r: _num(r.us)), ("floor us", 8, lambda r: _num(r.floor_us)),
    ("x floor", 7, lambda r: _num(r.over_floor, 2)),
    ("roof us", 8, lambda r: _num(r.roofline_us)),
    ("x roof", 6, lambda r: _num(r.over_roofline, 2)),
    ("speedup", 7, lambda r: _num(r.speedup, 2)),
    ("TB/s uniq", 9, lambda r: _num(r.tbps(r.unique_bytes), 2)),
    ("TB/s logi", 9, lambda r: _num(r.tbps(r.logical_bytes), 2)),
    ("KV MiB", 8, lambda r: _num(r.kv_bytes / 2**20)),
    ("sep. MiB", 8, lambda r: _num(r.kv_separate_bytes / 2**20)),
    ("rel err", 7, lambda r: "-" if r.error is None else f"{r.error:.0e}"),
    ("FastTree", 8, lambda r: _num(r.fasttree_us)), ("SDPA ref", 8, lambda r: _num(r.sdpa_ref_us)),
)


def format_header() -> str:
    head = " ".join(f"{name:>{width}}" if i > 2 else f"{name:{width}}"
                    for i, (name, width, _) in enumerate(COLUMNS))
    return head + "\n" + "-" * len(head)


def format_row(row: Row) -> str:
    return " ".join(f"{value(row):>{width}}" if i > 2 else f"{value(row):{width}}"
                    for i, (_, width, value) in enumerate(COLUMNS))


#: The performance targets (docs/performance.md): a geometric mean of time/floor over the cases
#: of these head layouts whose floor is at least SMALL_FLOOR_US; every case below it, a time limit.
TARGET_LAYOUTS = ("q32kv8", "q32kv32")
SMALL_FLOOR_US = 10.0


def summary(rows: list[Row]) -> str:
    """The performance targets: geometric means of time/floor per head layout (and
    q16kv1's over all its cases), the worst case, the slowest small case."""
    lines = []
    timed = [r for r in rows if r.op == "tree_attention" and r.over_floor is not None]
    for layout, limit in [(t, SMALL_FLOOR_US) for t in TARGET_LAYOUTS] + [("q16kv1", 0.0)]:
        picked = [r for r in timed if r.case.endswith(layout) and r.floor_us >= limit]
        if picked:
            geo = geomean([r.over_floor for r in picked])
            worst = max(picked, key=lambda r: r.over_floor)
            lines.append(f"tree_attention {layout} (floor >= {limit:g} us): geomean "
                         f"{geo:.2f}x floor over {len(picked)} cases, worst {worst.case} "
                         f"{worst.over_floor:.2f}x")
    lines += _roofline_summary(rows)
    small = [r for r in timed if r.floor_us < SMALL_FLOOR_US]
    if small:
        worst = max(small, key=lambda r: r.us)
        lines.append(f"tree_attention small cases (floor < {SMALL_FLOOR_US:g} us): slowest "
                     f"{worst.case} {worst.us:.1f} us")
    slower = [r.case for r in rows if r.op == "tree_attention" and r.speedup is not None
              and r.speedup < 1]
    lines.append(f"tree_attention slower than paged_decode (no sharing) on {len(slower)} "
                 f"case(s){': ' + ', '.join(slower) if slower else ''}")
    return "\n".join(lines)


def _roofline_summary(rows: list[Row]) -> list[str]:
    """Geometric means of time/roofline per head layout and over every case, each with its
    worst case (the roofline counts the launch, so small cases are in)."""
    timed = [r for r in rows if r.op == "tree_attention" and r.over_roofline is not None]
    layouts = sorted({r.case.rsplit("/", 1)[-1] for r in timed})
    groups = [(layout, [r for r in timed if r.case.endswith("/" + layout)]) for layout in layouts]
    lines = []
    for name, picked in groups + ([("all cases", timed)] if len(groups) > 1 else []):
        worst = max(picked, key=lambda r: r.over_roofline)
        lines.append(f"tree_attention {name}: geomean "
                     f"{geomean([r.over_roofline for r in picked]):.2f}x roofline over "
                     f"{len(picked)} cases, worst {worst.case} {worst.over_roofline:.2f}x")
    return lines


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"
