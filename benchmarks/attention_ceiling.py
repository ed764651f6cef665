"""What the roofline's compute term asks against what a Triton attention loop can do: the work
of a compute-bound shared root (256 decode rows of a GQA group of 4 over an 8192-token prompt,
8 KV heads: 1024 query rows per KV head), run by the fastest of a few plain Triton
flash-attention loops over dense K/V (TMA descriptors, no pages, masks, partials or merge;
64- and 128-row tiles, 32- to 128-key steps, 2 or 3 stages, each with and without
``warp_specialize``, split over the keys for one or a few waves): the rate the usual Triton
attention loop reaches on these FLOPs, where the roofline divides them by the dense
matrix-multiply rate. Beside it: that rate (an 8192-cube bf16 product), PyTorch's SDPA
on the same FLOPs (cuDNN and flash backends, K/V repeated per query head) and this package's
plan of the tree. Every loop is checked against a float32 reference before it is timed; a
wrong one (NaN included) is reported and left out. Times as the bench takes them
(``timing.median_us_each``: L2 flushed, events, median). Run on a GPU:
python benchmarks/attention_ceiling.py [--head-dims 64,128,256] [--json out.json]"""
import argparse
import itertools
import json
import math
import sys
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from flash_reasoning import TreeAttentionPlan, reference
from flash_reasoning.tools import bench, timing

RUNS = 15
QO_HEADS, KV_HEADS, SAMPLES, PROMPT = 32, 8, 256, 8192
ROWS = SAMPLES * QO_HEADS // KV_HEADS  # query rows per KV head
#: Programs a loop's grid may have: about one to four waves of 132 SMs.
MIN_PROGRAMS, MAX_PROGRAMS = 100, 600


@triton.jit
def dense_attention(q_desc, k_desc, v_desc, out, rows, keys, keys_per_split, scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Program (tile, head, split): a BLOCK_M-row tile of ``rows`` query rows against keys
    [split * keys_per_split, +keys_per_split) of its head; the normalised fp32 output."""
    tile, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q = q_desc.load([head * rows + tile * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = split * keys_per_split
    for n in tl.range(start, start + keys_per_split, BLOCK_N, num_stages=STAGES,
                      warp_specialize=WARP_SPECIALIZE):
        scores = tl.dot(q, k_desc.load([head * keys + n, 0]).T) * scale_log2
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([head * keys + n, 0]), acc * alpha[:, None])
        m_i = m_new
    r = (split * tl.num_programs(1) + head) * rows + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out + r[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc / l_i[:, None])


def loop_configs(head_dim: int):
    """(BLOCK_M, BLOCK_N, warps, stages, warp_specialize, splits): one warpgroup per 64 rows,
    key steps whose stages fit shared memory, grids of about one to four waves."""
    steps = (32, 64) if head_dim == 256 else (64, 128)
    for block_m, block_n, stages, ws, splits in itertools.product(
            (64, 128), steps, (2, 3), (False, True), (1, 2, 4)):
        programs = ROWS // block_m * KV_HEADS * splits
        if MIN_PROGRAMS <= programs <= MAX_PROGRAMS:
            yield block_m, block_n, block_m // 16, stages, ws, splits


def split_attention(q, k, v, splits: int) -> torch.Tensor:
    """float32 attention of each head's rows over each split's keys, in the loop's output
    order (split, head, row)."""
    head_dim = q.shape[-1]
    q, k, v = (t.view(KV_HEADS, -1, head_dim).float() for t in (q, k, v))
    parts = [torch.softmax(q @ ks.transpose(1, 2) * head_dim**-0.5, -1) @ vs
             for ks, vs in zip(k.chunk(splits, 1), v.chunk(splits, 1))]
    return torch.cat(parts).view(-1, head_dim)


def loops(head_dim: int) -> tuple[dict, list]:
    """Each config's launch over fresh random q, K, V, checked against :func:`split_attention`
    first, and the configs that gave a wrong result (NaN included): those are left out, as are
    the ones that do not fit shared memory."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(KV_HEADS * n, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for n in (ROWS, PROMPT, PROMPT))
    scale_log2 = head_dim**-0.5 * math.log2(math.e)
    wants, fns, wrong = {}, {}, []
    for cfg in loop_configs(head_dim):
        block_m, block_n, warps, stages, ws, splits = cfg
        out = torch.full((splits * KV_HEADS * ROWS, head_dim), float("nan"), device="cuda")
        descs = (TensorDescriptor.from_tensor(q, [block_m, head_dim]),
                 *(TensorDescriptor.from_tensor(t, [block_n, head_dim]) for t in (k, v)))

        def launch(descs=descs, out=out, cfg=cfg):
            block_m, block_n, warps, stages, ws, splits = cfg
            dense_attention[(ROWS // block_m, KV_HEADS, splits)](
                *descs, out, ROWS, PROMPT, PROMPT // splits, scale_log2, head_dim, block_m,
                block_n, stages, ws, num_warps=warps)
        try:
            launch()
        except OutOfResources:
            continue
        if splits not in wants:
            wants[splits] = split_attention(q, k, v, splits)
        err = reference.relative_error(out, wants[splits])  # NaN: inf
        if not err <= reference.TOLERANCE[torch.bfloat16]:
            print(f"  loop {cfg} is wrong (relative error {err:.3g}): left out")
            wrong.append(list(cfg))
            continue
        fns[cfg] = launch
    return fns, wrong


def others(head_dim: int) -> dict:
    """PyTorch's SDPA on the same FLOPs and the package's plan of the tree they come from."""
    q = torch.randn(1, QO_HEADS, SAMPLES, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, PROMPT, head_dim, device="cuda", dtype=torch.bfloat16)
            .repeat_interleave(QO_HEADS // KV_HEADS, 1) for _ in range(2))
    fns = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        try:
            sdpa()
        except RuntimeError as err:  # a backend that does not take this head_dim
            print(f"{name} at head_dim {head_dim}: {str(err).splitlines()[0]}")
            continue
        fns[name] = sdpa
    case = bench.level_case("root", [1, SAMPLES], [PROMPT, 1], QO_HEADS, KV_HEADS, head_dim,
                            "bfloat16")
    alloc, leaves = bench.case_allocator(case, random=False)
    plan = TreeAttentionPlan(alloc, leaves, QO_HEADS)
    decode_q = torch.randn(SAMPLES, QO_HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(decode_q)
    fns["tree_attention"] = lambda: plan.run(decode_q, 0, out)
    return fns


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128,256",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    matmul = timing.matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: dense bf16 matmul {matmul:.0f} TFLOP/s")
    results = []
    for head_dim in args.head_dims:
        flops = 4 * head_dim * ROWS * KV_HEADS * PROMPT
        loop_fns, wrong = loops(head_dim)
        times = timing.median_us_each({**loop_fns, **others(head_dim)}, runs=RUNS)
        best = min(loop_fns, key=times.get)
        row = {"head_dim": head_dim, "gflop": flops / 1e9, "best_loop": list(best),
               "wrong": wrong,
               "tflops": {str(key): flops / us / 1e6 for key, us in times.items()}}
        results.append(row)
        print(f"head_dim {head_dim} ({flops / 1e9:.1f} GFLOP):")
        for key in [best, "sdpa_cudnn", "sdpa_flash", "tree_attention"]:
            if key in times:
                rate = flops / times[key] / 1e6
                print(f"  {str(key):34s} {times[key]:8.1f} us {rate:5.0f} TFLOP/s "
                      f"({rate / matmul:.2f} of the matmul)")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "matmul_tflops": matmul,
                "date": datetime.now(timezone.utc).date().isoformat(), "runs": RUNS,
                "shape": {"num_qo_heads": QO_HEADS, "num_kv_heads": KV_HEADS,
                          "samples": SAMPLES, "prompt": PROMPT}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
