"""Generated families of trees and model shapes, for judging the planner's rules on trees
they were not fitted on (``flash-reasoning bench --family NAME``).

A family is a seeded list of cases in the bench's case format, each carrying its tree as
``parent``/``seqlen`` arrays (a :class:`~flash_reasoning.tools.trees.TreeSpec`). Cases
alternate between two halves: ``fit`` (with the cases file, what rules and tuning tables
may be fitted on) and ``held-out`` (what they are judged on). Node lengths are drawn freely,
so most forks fall inside a KV page. Every shape is a real reasoning model's attention
(query heads / KV heads), at head_dim 64, 128 or 256, in float16 or bfloat16.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .trees import TreeSpec

#: (query heads, KV heads) of reasoning models' attention.
MODEL_HEADS = ((32, 8), (28, 4), (40, 8), (64, 8), (8, 1), (12, 2), (32, 32))
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
HALVES = ("fit", "held-out")
#: Cases in the bench's family, both halves (``flash-reasoning bench --family-size``).
SIZE = 300


@dataclass(frozen=True)
class Limits:
    """How large a family's trees get: the GPU's ("a few ms" a case), or the CPU's."""
    max_unique_tokens: int
    max_logical_tokens: int
    max_branches: int
    max_nodes: int          # of a random tree
    token_scale: float      # drawn lengths are multiplied by this (at least 1 token)


GPU = Limits(max_unique_tokens=1 << 20, max_logical_tokens=1 << 23, max_branches=1024,
             max_nodes=1000, token_scale=1.0)
CPU = Limits(max_unique_tokens=4096, max_logical_tokens=1 << 15, max_branches=32,
             max_nodes=60, token_scale=1 / 64)
#: Draws per case before a family gives up (its limits leave no tree of some generator).
MAX_DRAWS = 1000


def _scaled(rng: random.Random, low: int, high: int, limits: Limits) -> int:
    """A length drawn log-uniformly from [low, high], scaled for ``limits``."""
    drawn = round(np.exp(rng.uniform(np.log(low), np.log(high))))
    return max(1, round(drawn * limits.token_scale))


def parallel_sampling(rng: random.Random, limits: Limits) -> TreeSpec:
    """A prompt of 256-16k tokens, then 2-256 samples of 16-8k tokens each."""
    samples = min(rng.randint(2, 256), limits.max_branches)
    prompt, each = _scaled(rng, 256, 16384, limits), _scaled(rng, 16, 8192, limits)
    return TreeSpec(np.array([-1] + [0] * samples), np.array([prompt] + [each] * samples))


def beam_search(rng: random.Random, limits: Limits) -> TreeSpec:
    """A long chain (1k-16k tokens) under 4-32 beams, each forked from it 1-64 tokens before
    its end (where the beams last diverged) and as long again."""
    chain = max(2, _scaled(rng, 1024, 16384, limits))
    beams = min(rng.randint(4, 32), limits.max_branches)
    offsets = [rng.randint(1, min(64, chain - 1)) for _ in range(beams - 1)]
    return _chain_with_forks(chain, [(chain - o, o) for o in offsets])


def tree_of_thought(rng: random.Random, limits: Limits) -> TreeSpec:
    """A prompt, then 2-6 levels of thoughts, each node 50-1000 tokens with 2-8 children
    (fewer where the leaves would pass the limit)."""
    parent, seqlen = [-1], [_scaled(rng, 256, 4096, limits)]
    frontier = [0]
    for _ in range(rng.randint(2, 6)):
        children = []
        for node in frontier:
            fan_out = rng.randint(2, 8)
            if len(children) + fan_out + len(frontier) > limits.max_branches:
                break
            for _ in range(fan_out):
                children.append(len(parent))
                parent.append(node)
                seqlen.append(_scaled(rng, 50, 1000, limits))
        if not children:
            break
        frontier = children
    return _pruned_to(TreeSpec(np.array(parent), np.array(seqlen)), limits.max_branches)


def short_leaves(rng: random.Random, limits: Limits) -> TreeSpec:
    """A prompt of 1k-8k tokens under 256-1024 leaves of 1-32 tokens."""
    leaves = min(rng.randint(256, 1024), limits.max_branches)
    prompt = _scaled(rng, 1024, 8192, limits)
    lengths = [max(1, round(rng.randint(1, 32) * max(limits.token_scale, 1 / 8)))
               for _ in range(leaves)]
    return TreeSpec(np.array([-1] + [0] * leaves), np.array([prompt] + lengths))


def random_tree(rng: random.Random, limits: Limits) -> TreeSpec:
    """50-1000 nodes of 1-512 tokens, each node's parent any earlier node."""
    nodes = rng.randint(min(50, limits.max_nodes), limits.max_nodes)
    parent, seqlen = [-1], [_scaled(rng, 64, 4096, limits)]
    for i in range(1, nodes):
        parent.append(rng.randrange(i))
        seqlen.append(_scaled(rng, 1, 512, limits))
    return _pruned_to(TreeSpec(np.array(parent), np.array(seqlen)), limits.max_branches)


def _chain_with_forks(chain: int, leaves: list[tuple[int, int]]) -> TreeSpec:
    """A chain of ``chain`` tokens split at each fork position, with a leaf of
    ``length`` tokens hanging at each ``(fork, length)``."""
    cuts = sorted({f for f, _ in leaves} | {chain})
    parent, seqlen, node_at = [], [], {}
    start = 0
    for cut in cuts:
        parent.append(len(parent) - 1)
        seqlen.append(cut - start)
        node_at[cut], start = len(parent) - 1, cut
    for fork, length in leaves:
        parent.append(node_at[fork])
        seqlen.append(length)
    return TreeSpec(np.array(parent), np.array(seqlen))


def _pruned_to(spec: TreeSpec, max_leaves: int) -> TreeSpec:
    """``spec`` with leaves dropped (last first) until at most ``max_leaves`` remain."""
    keep = np.ones(spec.num_nodes, bool)
    while True:
        has_child = np.zeros(spec.num_nodes, bool)
        has_child[spec.parent[keep & (spec.parent >= 0)]] = True
        leaves = np.flatnonzero(keep & ~has_child)
        if leaves.size <= max_leaves:
            break
        keep[leaves[max_leaves - leaves.size:]] = False
    index = np.cumsum(keep) - 1
    parent = np.where(spec.parent[keep] >= 0, index[np.maximum(spec.parent[keep], 0)], -1)
    return TreeSpec(parent, spec.seqlen[keep])


#: Family name -> its tree generators, drawn from in turn.
FAMILIES: dict[str, tuple[Callable[[random.Random, Limits], TreeSpec], ...]] = {
    "reasoning": (parallel_sampling, beam_search, tree_of_thought, short_leaves, random_tree),
}


def tree_case(name: str, spec: TreeSpec, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              dtype: str) -> dict:
    """``spec`` as a bench case (``bench.case_allocator`` builds it from parent/seqlen)."""
    leaves = spec.leaves()
    return {"name": name, "parent": spec.parent.tolist(), "seqlen": spec.seqlen.tolist(),
            "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "dtype": dtype, "branches": int(leaves.size), "unique_tokens": spec.unique_tokens,
            "logical_tokens": spec.logical_tokens}


def _within(limits: Limits, draw: Callable[[], TreeSpec]) -> TreeSpec:
    """The first tree ``draw`` gives within ``limits``' token counts ("a few ms" a case)."""
    for _ in range(MAX_DRAWS):
        spec = draw()
        if spec.unique_tokens <= limits.max_unique_tokens and \
                spec.logical_tokens <= limits.max_logical_tokens:
            return spec
    raise RuntimeError(f"no tree within {limits} in {MAX_DRAWS} draws")


def family_cases(name: str, count: int, seed: int = 0, half: str | None = None,
                 limits: Limits = GPU) -> list[dict]:
    """``count`` cases of family ``name`` (seeded: the same list every time), or the ones of
    ``half`` among them ("fit": even positions, "held-out": odd)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; families: {sorted(FAMILIES)}")
    if half is not None and half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    rng = random.Random(seed)
    generators = FAMILIES[name]
    cases = []
    while len(cases) < count:
        generate = generators[len(cases) % len(generators)]
        spec = _within(limits, lambda: generate(rng, limits))
        qo, kv = rng.choice(MODEL_HEADS)
        head_dim, dtype = rng.choice(HEAD_DIMS), rng.choice(DTYPES)
        shape = f"q{qo}kv{kv}d{head_dim}{'bf16' if dtype == 'bfloat16' else 'fp16'}"
        cases.append(tree_case(f"{generate.__name__}_{len(cases)}/{shape}", spec, qo, kv,
                               head_dim, dtype))
    return cases if half is None else cases[HALVES.index(half)::2]
