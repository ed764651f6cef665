import math

import pytest
import torch

from conftest import HAS_GPU, gpu, interpreter, poisoned_like
from flash_reasoning import paged_decode, reference
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.tools.synthetic import paged_problem

DTYPES = [torch.float16, torch.bfloat16]


def _check(out, problem, sm_scale=None):
    ref = reference.paged_decode(problem.q, problem.k_pool, problem.v_pool,
                                 problem.block_tables, problem.seq_lens, sm_scale)
    err = reference.relative_error(out, ref)
    assert err < reference.TOLERANCE[problem.q.dtype], f"relative error {err}"


def _interpret(problem, num_splits, sm_scale=0.125):
    from aot.interpret import run_interpreted
    out = poisoned_like(problem.q)
    launches = decode_launches(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                               problem.seq_lens, out, sm_scale, arch="sm90", num_sms=132,
                               num_splits=num_splits)
    # 16-token pages run the kernel compiled for them, 8-token ones the run-time page size.
    assert launches[0].spec.key["PAGE"] == (16 if problem.k_pool.shape[1] == 16 else 0)
    run_interpreted(launches)
    return out


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])   # GQA groups 1, 4, 8
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_interpreted(dtype, heads, num_splits):
    problem = paged_problem([37, 1, 80, 16], *heads, head_dim=64, block_size=16, dtype=dtype,
                            seed=num_splits * 10 + heads[1])
    _check(_interpret(problem, num_splits), problem, sm_scale=0.125)


@interpreter
@pytest.mark.parametrize("head_dim", [128, 256])
def test_kernel_interpreted_head_dims(head_dim):
    problem = paged_problem([33, 70], 4, 2, head_dim=head_dim, block_size=8, seed=head_dim)
    _check(_interpret(problem, 2), problem, sm_scale=0.125)


@interpreter
def test_kernel_interpreted_group_wider_than_tile():
    """A GQA group of 32 needs two 16-row tiles per KV head."""
    problem = paged_problem([20, 45], 32, 1, head_dim=64, seed=3)
    _check(_interpret(problem, 1), problem, sm_scale=0.125)


@interpreter
def test_kernel_interpreted_empty_sequences_give_zeros():
    problem = paged_problem([0, 5, 0], 4, 2, head_dim=64, seed=4)
    out = _interpret(problem, 2)
    assert torch.equal(out[0].float(), torch.zeros_like(out[0].float()))
    _check(out, problem, sm_scale=0.125)


@interpreter
def test_kernel_interpreted_more_splits_than_tokens():
    problem = paged_problem([3, 17], 4, 4, head_dim=64, seed=5)
    _check(_interpret(problem, 8), problem, sm_scale=0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_matches_reference(dtype):
    problem = paged_problem([19, 64, 0, 5], 8, 2, head_dim=128, dtype=dtype, seed=6)
    out = paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                       problem.seq_lens, out=poisoned_like(problem.q))
    _check(out, problem)


def test_default_scale_is_inverse_sqrt_head_dim():
    problem = paged_problem([9, 30], 4, 2, head_dim=64, seed=7)
    out = paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                       problem.seq_lens)
    _check(out, problem, sm_scale=1 / math.sqrt(64))


def test_reference_catches_a_wrong_answer():
    """The check itself must be able to fail: a shifted output and NaN are rejected."""
    problem = paged_problem([9, 30], 4, 2, head_dim=64, seed=8)
    ref = reference.paged_decode(problem.q, problem.k_pool, problem.v_pool,
                                 problem.block_tables, problem.seq_lens)
    assert reference.relative_error(ref * 1.01, ref) > 2e-3
    bad = ref.clone()
    bad[0, 0, 0] = float("nan")
    assert reference.relative_error(bad, ref) == math.inf


BAD_INPUTS = {
    "q dtype": (lambda p: dict(q=p.q.float()), TypeError, "float16"),
    "head_dim": (lambda p: dict(q=p.q[..., :48].contiguous()), ValueError, "head_dim 48"),
    "heads": (lambda p: dict(q=p.q[:, :3].contiguous()), ValueError, "multiple of num_kv_heads"),
    "table dtype": (lambda p: dict(block_tables=p.block_tables.long()), TypeError, "block_tables"),
    "table rows": (lambda p: dict(block_tables=p.block_tables[:1]), ValueError, "block_tables"),
    "lens shape": (lambda p: dict(seq_lens=p.seq_lens[:1]), ValueError, "seq_lens"),
    "too long": (lambda p: dict(seq_lens=p.seq_lens + 1000), ValueError, "seq_lens must lie"),
    "pool dim": (lambda p: dict(k_pool=p.k_pool[..., :32]), ValueError, "k_pool"),
    "out shape": (lambda p: dict(out=p.q[:1].clone()), ValueError, "out must have"),
    "out is q": (lambda p: dict(out=p.q), ValueError, "out overlaps q"),
    "strided q": (lambda p: dict(q=p.q.transpose(0, 1).contiguous().transpose(0, 1)),
                  ValueError, "q must be contiguous"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_rejected(case):
    problem = paged_problem([9, 30], 4, 2, head_dim=64, seed=9)
    change, error, message = BAD_INPUTS[case]
    args = dict(q=problem.q, k_pool=problem.k_pool, v_pool=problem.v_pool,
                block_tables=problem.block_tables, seq_lens=problem.seq_lens)
    args.update(change(problem))
    with pytest.raises(error, match=message):
        paged_decode(**args)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,lens", [((32, 8), [2048] * 64), ((32, 8), [1, 700, 2048]),
                                        ((16, 1), [5000]), ((8, 8), [129, 0, 33])])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_matches_reference(dtype, heads, lens, head_dim):
    problem = paged_problem(lens, *heads, head_dim=head_dim, dtype=dtype, device="cuda",
                            seed=len(lens) + head_dim)
    out = paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                       problem.seq_lens, out=poisoned_like(problem.q))
    torch.cuda.synchronize()
    _check(out, problem)


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU-only error")
def test_gpu_only_call_without_gpu_is_a_clear_error():
    from flash_reasoning import runtime
    with pytest.raises(RuntimeError, match="no CUDA device"):
        runtime.require_cuda()
