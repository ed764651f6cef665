"""The leaves' KV prefetched into L2 while the shared root computes (sm90): each plan with a
final kernel run as shipped, after a prefetch launch on the same stream, and beside a prefetch
launch on a second stream; the prefetch covers the first X MB of the pages the final launch
reads (in its programs' order), one ``cp.async.bulk.prefetch.L2`` per 8 KB of K and of V. Then
the final launch alone (events around it only) after the L2 flush, a prefetch of X MB (bulk, or
plain loads) and a sleep that lets it land; ``hot``: right after a run of itself. The data
behind docs/perf.md session 16 (the final kernel barely gains from L2: not pursued).
Run on a GPU: PYTHONPATH=.:python python3 ci/explore_prefetch.py [CASE...]"""
import statistics
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from flash_reasoning import TreeAttentionPlan, bench, runtime, timing

RUNS = 30
MEGABYTES = (8, 16, 24, 32, 48, None)  # None: every page of the final ranges
BLOCK = 32
PIECE = 8192
LAND_CYCLES = 40_000  # ~20 us at 1.98 GHz: a prefetch of 50 MB lands in ~17 us


@triton.jit
def prefetch_pieces(offsets, num_pieces, k_pool, v_pool, piece_bytes, sink, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_pieces
    offset = tl.load(offsets + i, mask=ok, other=0)
    nbytes = tl.where(ok, piece_bytes, 0)
    issued = tl.zeros([BLOCK], tl.int32)
    for pool in tl.static_range(2):
        base = k_pool.to(tl.int64) if pool == 0 else v_pool.to(tl.int64)
        issued += tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2;"
            " mov.u32 $0, 1; }", "=r,l,r", [base + offset, nbytes], dtype=tl.int32,
            is_pure=False, pack=1)
    tl.store(sink + i, issued, mask=ok)


@triton.jit
def load_pieces(offsets, k_pool, v_pool, sink, PIECE_ELEMS: tl.constexpr):
    """The same pieces read by plain loads (what surely leaves them in L2)."""
    offset = tl.load(offsets + tl.program_id(0)) // 2
    e = tl.arange(0, PIECE_ELEMS)
    total = tl.sum(tl.load(k_pool + offset + e).to(tl.float32), 0)
    total += tl.sum(tl.load(v_pool + offset + e).to(tl.float32), 0)
    tl.store(sink + tl.program_id(0), total.to(tl.int32))


def final_pages(plan, tables):
    """The page ids the final launch reads, in its programs' order (rows ``order`` when
    packed, else row order)."""
    arrays = plan.arrays
    rows = arrays.order if arrays.final_lanes > 1 else np.arange(plan.num_branches)
    lengths = plan.lengths.cpu().numpy()
    page = plan.allocator.block_size
    out = []
    for b in rows:
        first, end = int(arrays.final_start[b]) // page, -(-int(lengths[b]) // page)
        out.extend(tables[b, first:end].tolist())
    return out


def prefetcher(pages, k_pool, v_pool, page_bytes, loads=False):
    """A launch that brings ``pages`` of both pools into L2 in PIECE-byte pieces: bulk prefetches
    BLOCK pieces a program of one warp (one SM's bulk prefetches run at ~0.27 TB/s, so they are
    spread over many), or with ``loads`` one program of plain loads per piece."""
    piece = min(PIECE, page_bytes)
    offsets = [p * page_bytes + j * piece for p in pages for j in range(page_bytes // piece)]
    ids = torch.tensor(offsets or [0], dtype=torch.int64, device="cuda")
    n = len(offsets)
    sink = torch.empty(max(1, n), dtype=torch.int32, device="cuda")
    if loads:
        return lambda: load_pieces[(max(1, n),)](ids, k_pool, v_pool, sink,
                                                 PIECE_ELEMS=piece // 2, num_warps=4)
    grid = (max(1, triton.cdiv(n, BLOCK)),)
    return lambda: prefetch_pieces[grid](ids, n, k_pool, v_pool, piece, sink, BLOCK=BLOCK,
                                         num_warps=1)


def timed_after(pairs, runs):
    """Median us of ``run`` alone (events around it only), after the L2 flush, ``setup``
    and a sleep that lets its prefetches land: ``pairs`` maps a key to (setup, run)."""
    flush = torch.ones(timing.L2_FLUSH_BYTES // 8, dtype=torch.int64, device="cuda")
    times = {key: [] for key in pairs}
    for _ in range(runs):
        for key, (setup, run) in pairs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.sum()
            setup()
            torch.cuda._sleep(LAND_CYCLES)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times[key].append(start.elapsed_time(end) * 1e3)
    return {key: statistics.median(t) for key, t in times.items()}


def explore(name, case):
    alloc, leaves = bench.case_allocator(case)
    heads = case["num_qo_heads"]
    q = torch.randn(len(leaves), heads, case["head_dim"], device="cuda").to(alloc.dtype)
    out = torch.empty_like(q)
    plan = TreeAttentionPlan(alloc, leaves, heads)
    if plan.arrays.separate_merge or not plan.arrays.items:
        print(f"{name:24} no partial launch before a final one", flush=True)
        return
    k_pool, v_pool = alloc.k_pools[0], alloc.v_pools[0]
    page_bytes = k_pool[0].numel() * k_pool.element_size()  # [blocks, page, heads, dim]
    tables = plan.tables.cpu().numpy()
    pages = final_pages(plan, tables)
    total_mb = 2 * len(pages) * page_bytes / 1e6
    final = plan.launches(q, k_pool, v_pool, out)[-1]
    side = torch.cuda.Stream()

    def pages_for(mb):
        return pages if mb is None else pages[:int(mb * 1e6 / (2 * page_bytes))]

    def beside(fetch):
        def fn():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fetch()
            plan.run(q, 0, out)
            torch.cuda.current_stream().wait_stream(side)
        return fn

    def run_final():
        runtime.run([final], q.device)

    whole = {"shipped": lambda: plan.run(q, 0, out)}
    alone = {"hot": (run_final, run_final)}
    for mb in (0,) + MEGABYTES:
        label = "all" if mb is None else str(mb)
        fetch = prefetcher(pages_for(mb), k_pool, v_pool, page_bytes)
        whole[f"same {label}"] = lambda f=fetch: (f(), plan.run(q, 0, out))
        whole[f"beside {label}"] = beside(fetch)
        alone[label] = (fetch, run_final)
        alone[f"{label} by loads"] = (prefetcher(pages_for(mb), k_pool, v_pool, page_bytes,
                                                 loads=True), run_final)
    times = bench.check_and_time(name, whole, lambda fn: (out.fill_(float("nan")), fn(),
                                                          torch.cuda.synchronize(),
                                                          out.clone())[-1], RUNS)
    alone_us = timed_after(alone, RUNS)
    print(f"{name:24} final reads {total_mb:.1f} MB of leaves; "
          + " ".join(f"{k}:{v:.1f}" for k, v in times.items()), flush=True)
    print(f"{'':24} final alone after X MB in L2: "
          + " ".join(f"{k}:{v:.1f}" for k, v in alone_us.items()), flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or [
        "seed_b256/q32kv8", "seed_b128/q32kv8", "ft_1,1024/q32kv8", "ft_1,256/q32kv8",
        "ft_1,4,256/q32kv8", "ft_1,16,64/q32kv8", "ft_deep16/q32kv8", "ft_1,4,16,512/q32kv8",
        "seed_b256/q32kv32", "ft_1,4,256/q32kv32"])
