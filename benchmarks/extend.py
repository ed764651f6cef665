"""Several queries per branch: ``tree_attention`` with ``q_lens`` (extend steps and draft
verification) beside PyTorch SDPA over per-branch copies and beside ``paged_decode`` with
each query as its own row (nothing shared), with the roofline.

Cases (float16, 32 query heads over 8 KV heads, head_dim 128, blocks of 16):

- ``extend_b{B}_n{N}``: B branches forked from a 2048-token prompt, each extended by N tokens
  (written before the call), its N queries attending the prompt and causally each other;
- ``verify_{tree}_k{K}``: a tree of the cases file, each leaf given a chain of K draft tokens
  to verify (K queries per leaf, causal);
- ``draft_{tree}_k{K}``: the same leaves each given a random draft *tree* of K tokens
  (``mask``: each query attends its ancestors in the draft and itself); no decode-rows
  column (a query's tokens are not a prefix of its branch).

Roofline (as ``flash-reasoning bench``): the unique KV bytes plus the queries' and outputs'
bytes at the copy bandwidth, or the FLOPs (4 x head_dim x query heads per (query, key it
attends, under its mask)) at the fp16 matmul rate, whichever is longer, plus one launch.
Times: CUDA events, median, L2 flushed by a read (``tools.timing``). ``err``: each op's
relative error against the float64 reference on the first branches' rows.

``python benchmarks/extend.py [--cases extend,verify,draft] [--json out.json]``; ``--smoke`` runs
tiny cases on CPU (the PyTorch path) and checks every op against the reference, untimed.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from flash_reasoning import PhysicalKVAllocator, TreeAttentionPlan, paged_decode, reference
from flash_reasoning.tools import bench, timing
from flash_reasoning.tools.synthetic import draft_tree_mask, random_kv

SHAPE = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
PROMPT = 2048
EXTEND = [(b, n) for n in (16, 64, 256) for b in (8, 64, 256)]
VERIFY = [(tree, k) for tree in ("seed_b16/q32kv8", "ft_1,2,64/q32kv8", "ft_1,4,256/q32kv8")
          for k in (4, 32)]
SMOKE_SHAPE = {"num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}
CHECKED_BRANCHES = 4  # the reference's rows: enough to catch a wrong causal cut, cheap in float64


def extend_problem(branches: int, new: int, prompt: int, device: str, shape=SHAPE):
    """``branches`` forks of a ``prompt``-token root, each holding ``new`` more tokens."""
    blocks = -(-prompt // 16) + branches * (-(-new // 16) + 1) + 1
    alloc = PhysicalKVAllocator(blocks, 16, shape["num_kv_heads"], shape["head_dim"],
                                dtype=getattr(torch, shape["dtype"]), device=device)
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, prompt))
    ids = [b.branch_id for b in alloc.alloc_branches(branches, prompt, root)]
    alloc.append(alloc.reserve(ids, new), 0, *random_kv(alloc, gen, branches * new))
    return alloc, ids


def verify_problem(name: str, draft: int, device: str):
    """The cases file's tree ``name``, each leaf holding ``draft`` more tokens."""
    case = next(c for c in bench.load_cases()["cases"] if c["name"] == name)
    alloc, leaves = bench.case_allocator(case, device,
                                         spare_blocks=case["branches"] * (-(-draft // 16) + 1))
    gen = torch.Generator().manual_seed(1)
    alloc.append(alloc.reserve(leaves, draft), 0, *random_kv(alloc, gen, len(leaves) * draft))
    return alloc, leaves


def draft_masks(q_lens, seed: int = 3) -> list[torch.Tensor]:
    """A random draft tree's mask per branch (``synthetic.draft_tree_mask``)."""
    gen = torch.Generator().manual_seed(seed)
    return [draft_tree_mask(n, gen) for n in q_lens]


def roofline_us(alloc, ids, q_lens, machine: bench.Machine, masks=None) -> float:
    lengths = alloc.lengths(ids)
    new_keys = [n * (n + 1) // 2 for n in q_lens] if masks is None else \
        [int(m.sum()) for m in masks]  # keys each branch's queries attend among the new
    attended = sum(int(n) * (int(length) - int(n)) + new
                   for length, n, new in zip(lengths, q_lens, new_keys))
    heads, dim = SHAPE["num_qo_heads"], alloc.head_dim
    unique = alloc.memory_report().tokens_physical * alloc.bytes_per_token_per_layer
    moved = unique + 2 * sum(q_lens) * heads * dim * alloc.k_pools[0].element_size()
    compute_us = 4 * dim * heads * attended / (machine.matmul_tflops * 1e12) * 1e6
    return max(moved / (machine.copy_bandwidth_tbps * 1e12) * 1e6, compute_us) + \
        machine.launch_us


def sdpa_over_copies(alloc, ids, q_lens, q, masks=None):
    """PyTorch SDPA on each branch's path copied out dense (padded to the longest), with the
    causal (or draft) mask of its queries: what an engine without shared-prefix attention
    runs."""
    copies = bench.Separate.from_tree(alloc, ids)
    k, v = copies.k.transpose(1, 2), copies.v.transpose(1, 2)   # [branches, kv_heads, len, dim]
    new = q_lens[0]
    position = torch.arange(k.shape[2], device=q.device)
    first_new = copies.lengths.long()[:, None, None] - new               # [b, 1, 1]
    query_end = first_new[:, :, 0] + torch.arange(1, new + 1, device=q.device)
    mask = position[None, None, :] < query_end[:, :, None]               # [b, new, len]
    if masks is not None:  # the new tokens as each branch's draft mask allows
        mask = (position[None, None, :] < first_new).expand(-1, new, -1).clone()
        for b, m in enumerate(masks):
            start = int(first_new[b])
            mask[b, :, start:start + new] = m.to(q.device)
    mask = mask[:, None]                                                 # [b, 1, new, len]
    qb = q.view(len(ids), new, *q.shape[1:]).transpose(1, 2)            # [b, heads, new, dim]
    return lambda: F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)


def ops(alloc, ids, q_lens, q, masks=None):
    """Each op as a callable returning its ``[rows, heads, dim]`` output (no decode rows under
    draft masks: a query's tokens are not a prefix of its branch)."""
    plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens, mask=masks)
    plan.refresh()
    out = torch.empty_like(q)
    sdpa = sdpa_over_copies(alloc, ids, q_lens, q, masks)
    rows = q.shape[0]
    fns = {"tree": lambda: plan.run(q, 0, out),
           "sdpa": lambda: sdpa().transpose(1, 2).reshape(rows, *q.shape[1:])}
    if masks is None:
        fns["decode_rows"] = lambda: paged_decode(q, alloc.k_pools[0], alloc.v_pools[0],
                                                  plan.tables, plan.lengths, out=out)
    return fns


def errors(alloc, ids, q_lens, q, fns, masks=None) -> dict:
    """Each op's relative error against the float64 reference over the first branches."""
    n = CHECKED_BRANCHES
    rows = sum(q_lens[:n])
    expected = reference.tree_attention(q[:rows], alloc, ids[:n], q_lens=q_lens[:n],
                                        mask=None if masks is None else masks[:n])
    return {name: reference.relative_error(fn()[:rows], expected) for name, fn in fns.items()}


def run(name, alloc, ids, new, machine, num_qo_heads: int, masked: bool = False) -> dict:
    q_lens = [new] * len(ids)
    masks = draft_masks(q_lens) if masked else None
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), num_qo_heads, alloc.head_dim, generator=gen)
    q = q.to(alloc.dtype).to(alloc.device)
    fns = ops(alloc, ids, q_lens, q, masks)
    row = {"case": name, "branches": len(ids), "queries": new, "rows": q.shape[0],
           "err": errors(alloc, ids, q_lens, q, fns, masks)}
    if machine is not None:
        row["us"] = timing.median_us_each(fns, runs=30)
        row["roof_us"] = roofline_us(alloc, ids, q_lens, machine, masks)
    return row


def problems(kinds, device):
    if device != "cuda":  # smoke: tiny extends and the smallest verify tree
        for b, n in ((3, 4), (2, 9)):
            yield f"extend_b{b}_n{n}", n, extend_problem(b, n, 40, device, SMOKE_SHAPE)
        yield "verify_ft_1,2,64_k3", 3, verify_problem("ft_1,2,64/q32kv8", 3, device)
        yield "draft_ft_1,2,64_k5", 5, verify_problem("ft_1,2,64/q32kv8", 5, device)
        return
    if "extend" in kinds:
        for b, n in EXTEND:
            yield f"extend_b{b}_n{n}", n, extend_problem(b, n, PROMPT, device)
    if "verify" in kinds:
        for tree, k in VERIFY:
            yield f"verify_{tree.split('/')[0]}_k{k}", k, verify_problem(tree, k, device)
    if "draft" in kinds:
        for tree, k in VERIFY:
            yield f"draft_{tree.split('/')[0]}_k{k}", k, verify_problem(tree, k, device)


def format_row(row: dict) -> str:
    err = max(row["err"].values())
    if "us" not in row:
        return f"{row['case']:<24} {row['rows']:>6}  max err {err:.1e}"
    us = row["us"]
    return (f"{row['case']:<24} {row['rows']:>6} {us['tree']:>9.1f} {row['roof_us']:>8.1f} "
            f"{us['tree'] / row['roof_us']:>6.2f} {us['sdpa']:>9.1f} "
            f"{us.get('decode_rows', float('nan')):>9.1f}"
            f"  {err:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="extend,verify,draft")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    machine = None if args.smoke else bench.Machine(
        timing.copy_bandwidth_tbps(), timing.matmul_tflops(dtype=torch.float16),
        timing.launch_us())
    print(f"{'case':<24} {'rows':>6} {'tree us':>9} {'roof us':>8} {'x roof':>6} "
          f"{'sdpa us':>9} {'rows us':>9}  max err")
    rows = []
    for name, new, (alloc, ids) in problems(args.cases.split(","), device):
        heads = alloc.num_kv_heads * SHAPE["num_qo_heads"] // SHAPE["num_kv_heads"]
        rows.append(run(name, alloc, ids, new, machine, heads, name.startswith("draft")))
        print(format_row(rows[-1]), flush=True)
        tolerance = reference.TOLERANCE[alloc.dtype]
        if max(rows[-1]["err"].values()) >= tolerance:
            print(f"error above {tolerance}: {rows[-1]['err']}", file=sys.stderr)
            return 1
    if machine is not None:
        ratios = [r["us"]["tree"] / r["roof_us"] for r in rows]
        print(f"geomean x roof {bench.geomean(ratios):.2f} over {len(rows)} cases")
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.node(),
                "date": datetime.now(timezone.utc).date().isoformat(),
                "torch": torch.__version__, **({} if machine is None else vars(machine))}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "shape": SHAPE, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
