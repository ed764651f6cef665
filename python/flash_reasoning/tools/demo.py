"""``flash-reasoning demo``: a tree-of-thought decode of a tiny random-weight model.

Every ``--expand-every`` steps each live branch forks ``--expand`` children sharing its KV
blocks and the ``--width`` best by log-probability survive; each step prints what the pool
holds, what sharing saves against storing every branch separately, and the attention time.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import reference
from ..allocator import PhysicalKVAllocator, PoolExhausted
from ..dispatch import HEAD_DIMS
from ..ops.tree_attention import StalePlan, TreeAttentionPlan

VOCAB = 256
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MIB = 2 ** 20


def _int_at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in "invalid int value: ..."
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, default, text in (
            ("--width", 16, "live branches kept"), ("--expand", 4, "children per fork"),
            ("--expand-every", 4, "steps between expansions (step 0 expands)"),
            ("--steps", 32, "decode steps: the tree's depth"), ("--prefix", 128, "prompt tokens"),
            ("--layers", 4, None), ("--num-qo-heads", 8, None), ("--num-kv-heads", 2, None),
            ("--block-size", 16, "tokens per KV block")):
        parser.add_argument(name, type=_int_at_least(1), default=default, help=text)
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=64)
    parser.add_argument("--num-blocks", type=_int_at_least(2), default=None,
                        help="KV pool blocks, the zero block included (default: enough)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="KV dtype (default: float16 on cuda, float32 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="check layer 0's attention against the float64 reference")


def blocks_to_fit(args: argparse.Namespace) -> int:
    """Pool blocks this run can ever hold, the zero block included. Only decode steps take
    blocks, with at most ``width`` branches live: the prompt's full blocks (shared, never
    written again) plus each branch's table entries from the prompt's last block on."""
    longest = -(-(args.prefix + args.steps) // args.block_size)
    shared = args.prefix // args.block_size
    return 1 + shared + args.width * (longest - shared)


def _resolve(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Device and dtype, defaults filled in; ValueError for combinations that cannot run."""
    if args.num_qo_heads % args.num_kv_heads:
        raise ValueError(f"--num-qo-heads ({args.num_qo_heads}) must be a multiple of "
                         f"--num-kv-heads ({args.num_kv_heads})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
    dtype = DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    if device.type == "cuda" and dtype == torch.float32:
        raise ValueError("--dtype float32 runs on cpu only; the kernels take float16/bfloat16")
    return device, dtype


class RandomModel:
    """Per layer q/k/v/o projections around a residual stream, an embedding and an
    unembedding; drawn on the CPU so a seed gives the same weights on every device."""

    def __init__(self, args: argparse.Namespace, device: torch.device, gen: torch.Generator):
        self.head_dim = args.head_dim
        hidden, kv = args.num_qo_heads * args.head_dim, args.num_kv_heads * args.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) / math.sqrt(rows)).to(device)
        self.embed = torch.randn(VOCAB, hidden, generator=gen).to(device)
        self.layers = [(weight(hidden, hidden), weight(hidden, kv), weight(hidden, kv),
                        weight(hidden, hidden)) for _ in range(args.layers)]
        self.unembed = weight(hidden, VOCAB)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class Beam:
    """The live branches, row ``i`` of each field for ``ids[i]``."""
    ids: list[int]
    hidden: torch.Tensor  # [n, hidden] float32: the embedding of each branch's next token
    scores: torch.Tensor  # [n] float64 cumulative log-probability


def expand(alloc: PhysicalKVAllocator, beam: Beam, count: int) -> Beam:
    """Fork every branch ``count`` times at its length; the parent is freed, its KV blocks
    stay alive in the children that share them."""
    ids = []
    for parent in beam.ids:
        children = alloc.alloc_branches(count, alloc.length(parent), parent)
        ids += [child.branch_id for child in children]
        alloc.free_branch(parent)
    return Beam(ids, beam.hidden.repeat_interleave(count, 0),
                beam.scores.repeat_interleave(count, 0))


def keep_best(alloc: PhysicalKVAllocator, beam: Beam, width: int) -> Beam:
    """The ``width`` best-scoring branches (ties to the older branch); the rest are pruned."""
    ranked = np.lexsort((np.asarray(beam.ids), -beam.scores.numpy()))  # best first
    for i in ranked[width:]:
        alloc.prune(beam.ids[i])
    keep = sorted(ranked[:width].tolist())
    return Beam([beam.ids[i] for i in keep], beam.hidden[keep], beam.scores[keep])


class AttentionTimer:
    """Attention time of a step: CUDA event pairs read after one synchronize at the end of
    the step (no stall between layers), or wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.spans = device.type == "cuda", []

    def time(self, fn):
        if not self.cuda:
            start = time.perf_counter()
            result = fn()
            self.spans.append((time.perf_counter() - start) * 1e3)
            return result
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        result = fn()
        end.record()
        self.spans.append((start, end))
        return result

    def step_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self.spans = [start.elapsed_time(end) for start, end in self.spans]
        ms, self.spans = sum(self.spans), []
        return ms


def _fresh_plan(plan, alloc: PhysicalKVAllocator, beam: Beam, heads: int):
    """``plan`` while it still describes the tree (branches only grew), else a new one."""
    if plan is not None:
        try:
            plan.refresh()
            return plan
        except StalePlan:
            pass
    return TreeAttentionPlan(alloc, beam.ids, heads)


def decode(model: RandomModel, alloc: PhysicalKVAllocator, step, plan, beam: Beam,
           timer: AttentionTimer, check: bool) -> tuple[torch.Tensor, float]:
    """The reserved ``step`` of every branch through all layers: (logits, layer 0's
    relative error against the reference, NaN unchecked)."""
    n, hidden, error = len(beam.ids), beam.hidden, math.nan
    for layer, (wq, wk, wv, wo) in enumerate(model.layers):
        x = _rms_norm(hidden)
        q, k, v = ((x @ w).view(n, -1, model.head_dim).to(alloc.dtype) for w in (wq, wk, wv))
        alloc.append(step, layer, k, v)
        attn = timer.time(lambda: plan.run(q, layer))
        if check and layer == 0:
            ref = reference.tree_attention(q, alloc, beam.ids, layer)
            error = reference.relative_error(attn, ref)
        hidden = hidden + attn.float().reshape(n, -1) @ wo
    return _rms_norm(hidden) @ model.unembed, error


def sample(model: RandomModel, beam: Beam, logits: torch.Tensor, gen: torch.Generator) -> Beam:
    """Sample each branch's next token (on the CPU generator: reproducible), add its
    log-probability to the score and embed it as the next input."""
    logp = torch.log_softmax(logits.float(), -1).cpu().double()
    tokens = torch.multinomial(logp.exp(), 1, generator=gen)
    scores = beam.scores + logp.gather(1, tokens).squeeze(1)
    return Beam(beam.ids, model.embed[tokens.squeeze(1).to(model.embed.device)], scores)


def write_prompt(args, alloc: PhysicalKVAllocator, gen: torch.Generator) -> int:
    """A root branch holding ``--prefix`` random tokens in every layer; returns its id."""
    root = alloc.alloc_branch(0).branch_id
    shape = (args.prefix, args.num_kv_heads, args.head_dim)
    for layer in range(args.layers):
        k, v = (torch.randn(shape, generator=gen).to(alloc.device, alloc.dtype) for _ in "kv")
        alloc.write(root, layer, k, v)
    return root


def _header(args, device, dtype, num_blocks: int) -> None:
    print(f"tree-of-thought decode, random weights: {device}, {str(dtype)[6:]}, "
          f"{args.layers} layers, {args.num_qo_heads}/{args.num_kv_heads} heads x "
          f"{args.head_dim}, prompt {args.prefix}, width {args.width}, expand "
          f"{args.expand} every {args.expand_every} steps, pool {num_blocks - 1} blocks of "
          f"{args.block_size} tokens (+ the zero block)")
    print(f"{'step':>4} {'live':>5} {'new':>4} {'pruned':>6} {'blocks used/total':>17} "
          f"{'tokens logical/physical':>23} {'saved MiB (%)':>16}"
          f"{' ' + format('rel err', '>8') if args.check else ''} "
          f"{'attn ' + ('gpu' if device.type == 'cuda' else 'cpu') + ' ms':>12}")


def _step_line(step, live, new, pruned, report, ms, error) -> str:
    share = 100 * report.bytes_saved / report.bytes_separate
    err = "" if math.isnan(error) else f" {error:8.1e}"
    return (f"{step:>4} {live:>5} {new:>4} {pruned:>6} "
            f"{report.blocks_used:>8}/{report.blocks_total:<8} {report.tokens_logical:>11}/"
            f"{report.tokens_physical:<11} {report.bytes_saved / MIB:>8.3f} "
            f"{f'({share:.1f}%)':>7}{err} {ms:>12.3f}")


def simulate(args, device: torch.device, dtype: torch.dtype, num_blocks: int) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    model = RandomModel(args, device, gen)
    alloc = PhysicalKVAllocator(num_blocks, args.block_size, args.num_kv_heads,
                                args.head_dim, num_layers=args.layers, dtype=dtype,
                                device=device)
    first = model.embed[torch.randint(VOCAB, (1,), generator=gen).to(device)]
    beam = Beam([write_prompt(args, alloc, gen)], first, torch.zeros(1, dtype=torch.float64))
    timer, plan, plans, history = AttentionTimer(device), None, 0, []
    decode_step = None  # step 0 expands, so it reserves by ids
    _header(args, device, dtype, num_blocks)
    for step in range(args.steps):
        new = pruned = 0
        if step % args.expand_every == 0:
            beam = expand(alloc, beam, args.expand)
            new = len(beam.ids)
            beam = keep_best(alloc, beam, args.width)
            pruned = new - len(beam.ids)
        # The same branches as last step: reserve from that step (no id re-check).
        decode_step = alloc.reserve(beam.ids if new else decode_step)
        fresh = _fresh_plan(plan, alloc, beam, args.num_qo_heads)
        plan, plans = fresh, plans + (fresh is not plan)
        logits, error = decode(model, alloc, decode_step, plan, beam, timer, args.check)
        beam = sample(model, beam, logits, gen)
        history.append((alloc.memory_report(), timer.step_ms(), error))
        print(_step_line(step, len(beam.ids), new, pruned, *history[-1]), flush=True)
    return _summary(args, dtype, beam, history, plans)


def _summary(args, dtype: torch.dtype, beam: Beam, history: list, plans: int) -> int:
    reports, times, errors = zip(*history)
    final, best = reports[-1], int(beam.scores.argmax())
    print(f"summary: {args.steps} steps, {len(beam.ids)} live branches, peak "
          f"{max(r.blocks_used for r in reports)}/{final.blocks_total} blocks, "
          f"{plans} attention plans built")
    print(f"attention time: total {sum(times):.3f} ms, mean {sum(times) / len(times):.3f} "
          f"ms/step")
    print(f"memory saved: {final.bytes_saved / MIB:.3f} MiB of {final.bytes_separate / MIB:.3f}"
          f" MiB stored separately ({100 * final.bytes_saved / final.bytes_separate:.1f}%)")
    print(f"best branch: {beam.ids[best]}, score {beam.scores[best]:.3f} "
          f"(log-probability of its {args.steps} tokens)")
    if not args.check:
        return 0
    worst = max(errors, key=lambda e: (math.isnan(e), e))  # NaN counts as the worst
    tolerance = reference.TOLERANCE[dtype]
    if not worst <= tolerance:
        print(f"demo: check FAILED: layer 0 relative error {worst:.2e} exceeds "
              f"{tolerance:.0e} for {str(dtype)[6:]}", file=sys.stderr)
        return 1
    print(f"check: passed, max relative error {worst:.2e} <= {tolerance:.0e} "
          f"(layer 0, every step, against the float64 reference)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        device, dtype = _resolve(args)
    except ValueError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    num_blocks = args.num_blocks or blocks_to_fit(args)
    try:
        return simulate(args, device, dtype, num_blocks)
    except PoolExhausted as exc:
        print(f"demo: {exc}; raise --num-blocks (now {num_blocks}; leave it out to size the "
              f"pool for this run: {blocks_to_fit(args)})", file=sys.stderr)
        return 1
