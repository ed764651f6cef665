"""How fast the leaves can be read at all: ft_1,1024's leaves (1024 branches x 32 tokens in
16-token pages x 8 KV heads x head_dim 128, K and V: 134 MB) read and summed, nothing else,
by programs of (lanes of branches, KV head) that read each token's 256 bytes of one head (the
final kernel's pattern; each head's programs together or each program's heads together) and
by programs of one branch that read each token's 2 KB of all heads; pages in order and
shuffled; a copy of the same bytes as the bar. The final launch's bar (docs/perf.md session
28). Run on a GPU: PYTHONPATH=.:python python3 ci/explore_leaf_reads.py"""
import torch
import triton
import triton.language as tl

from flash_reasoning import timing

BRANCHES, TOKENS, KV_HEADS, HEAD_DIM, PAGE = 1024, 32, 8, 128, 16
RUNS = 50


@triton.jit
def read_one_head(k, v, table, out, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                  PAGE: tl.constexpr, LANES: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """One program: LANES branches' T tokens of one KV head, all loaded at once."""
    if HEADS_FIRST:
        program, head = tl.program_id(1), tl.program_id(0)
    else:
        program, head = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, LANES * T)
    branch = program * LANES + r // T
    n = r % T
    page = tl.load(table + branch * (T // PAGE) + n // PAGE)
    rows = (page.to(tl.int64) * PAGE + n % PAGE) * H + head
    off = rows[:, None] * D + tl.arange(0, D)[None, :]
    total = tl.sum(tl.load(k + off).to(tl.float32)) + tl.sum(tl.load(v + off).to(tl.float32))
    tl.store(out + program * H + head, total)


@triton.jit
def read_all_heads(k, v, table, out, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                   PAGE: tl.constexpr, STEP: tl.constexpr):
    """One program: one branch's T tokens of every head, STEP tokens (STEP x 2 KB) a load."""
    branch = tl.program_id(0)
    total = tl.zeros([STEP, H * D], tl.float32)
    for t0 in range(0, T, STEP):
        n = t0 + tl.arange(0, STEP)
        page = tl.load(table + branch * (T // PAGE) + n // PAGE)
        rows = page.to(tl.int64) * PAGE + n % PAGE
        off = rows[:, None] * (H * D) + tl.arange(0, H * D)[None, :]
        total += tl.load(k + off).to(tl.float32) + tl.load(v + off).to(tl.float32)
    tl.store(out + branch, tl.sum(total))


def readers(k, v, table, out):
    """Every variant, by name."""
    fns = {}
    for lanes in (1, 4):
        for heads_first in (0, 1):
            for warps in (2, 4):
                grid = ((KV_HEADS, BRANCHES // lanes) if heads_first
                        else (BRANCHES // lanes, KV_HEADS))
                fns[f"one head, {lanes} lanes, heads first {heads_first}, {warps} warps"] = (
                    lambda g=grid, l=lanes, f=heads_first, w=warps: read_one_head[g](
                        k, v, table, out, KV_HEADS, HEAD_DIM, TOKENS, PAGE, l, f, num_warps=w))
    for step in (4, 8, 16):
        for warps in (4, 8):
            fns[f"all heads, {step} tokens a load, {warps} warps"] = (
                lambda s=step, w=warps: read_all_heads[(BRANCHES,)](
                    k, v, table, out, KV_HEADS, HEAD_DIM, TOKENS, PAGE, s, num_warps=w))
    return fns


def main():
    pages = BRANCHES * TOKENS // PAGE
    k = torch.randn(pages * PAGE, KV_HEADS, HEAD_DIM, device="cuda").half()
    v = torch.randn_like(k)
    out = torch.empty(BRANCHES * KV_HEADS, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e6:.0f} MB of K and V (us, TB/s read)",
          flush=True)
    for layout in ("pages in order", "pages shuffled"):
        ids = torch.arange(pages) if layout == "pages in order" else torch.randperm(pages)
        table = ids.to(torch.int32).cuda()
        fns = readers(k, v, table, out)
        fns["bar: a copy of K (half the bytes read, as many written)"] = lambda: k.clone()
        for name, us in timing.median_us_each(fns, RUNS).items():
            read = nbytes / 2 if name.startswith("bar") else nbytes
            print(f"  {layout}, {name:56} {us:6.1f} {read / us / 1e6:5.2f}", flush=True)


if __name__ == "__main__":
    main()
