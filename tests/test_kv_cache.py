import pytest
import torch

from conftest import GPU_MARKS, gpu, interpreter
from flash_reasoning import kv_cache


def _pools(dtype, device="cpu", num_blocks=6, block_size=4, heads=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, dim)
    return (torch.randn(shape, generator=gen).to(dtype).to(device),
            torch.randn(shape, generator=gen).to(dtype).to(device))


def _new_rows(n, dtype, device="cpu", heads=2, dim=64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=gen).to(dtype).to(device),
            torch.randn(n, heads, dim, generator=gen).to(dtype).to(device))


def _expected(k_pool, v_pool, slots, k, v):
    k_ref, v_ref = k_pool.cpu().clone(), v_pool.cpu().clone()
    flat = slots.long().cpu()
    k_ref.view(-1, *k.shape[1:])[flat] = k.cpu()
    v_ref.view(-1, *v.shape[1:])[flat] = v.cpu()
    return k_ref, v_ref


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_kernel_interpreted(dtype):
    from aot.interpret import run_interpreted
    k_pool, v_pool = _pools(dtype)
    slots = torch.tensor([5, 0, 23, 12], dtype=torch.int64)
    k, v = _new_rows(len(slots), dtype)
    k_ref, v_ref = _expected(k_pool, v_pool, slots, k, v)
    run_interpreted(kv_cache.append_launches(k_pool, v_pool, slots, k, v, "sm90"))
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


@interpreter
def test_append_kernel_interpreted_rows_wider_than_a_program():
    """num_kv_heads * head_dim > APPEND_BLOCK: each row spans several programs."""
    from aot.interpret import run_interpreted
    k_pool, v_pool = _pools(torch.float16, heads=8, dim=256, num_blocks=2, block_size=2)
    slots = torch.tensor([3, 1], dtype=torch.int64)
    k, v = _new_rows(2, torch.float16, heads=8, dim=256)
    k_ref, v_ref = _expected(k_pool, v_pool, slots, k, v)
    run_interpreted(kv_cache.append_launches(k_pool, v_pool, slots, k, v, "sm90"))
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


def test_write_slots_cpu_path():
    k_pool, v_pool = _pools(torch.float16)
    slots = torch.tensor([7, 2])
    k, v = _new_rows(2, torch.float16)
    k_ref, v_ref = _expected(k_pool, v_pool, slots, k, v)
    kv_cache.write_slots(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


@pytest.mark.parametrize("change,error", [
    (dict(k=lambda k: k[:, :1]), ValueError), (dict(v=lambda v: v.float()), TypeError),
    (dict(k=lambda k: k[:1]), ValueError)])
def test_write_slots_rejects_bad_rows_and_changes_nothing(change, error):
    k_pool, v_pool = _pools(torch.float16)
    before = k_pool.clone(), v_pool.clone()
    k, v = _new_rows(2, torch.float16)
    k = change.get("k", lambda t: t)(k)
    v = change.get("v", lambda t: t)(v)
    with pytest.raises(error):
        kv_cache.write_slots(k_pool, v_pool, torch.tensor([1, 2]), k, v)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU_MARKS)])
def test_write_slots_never_attaches_the_pools_to_autograd(device):
    """K/V rows that require grad are copied as values: the pools stay plain tensors."""
    k_pool, v_pool = _pools(torch.float16, device)
    slots = torch.tensor([7, 2], device=device)
    k, v = _new_rows(2, torch.float16, device)
    k_ref, v_ref = _expected(k_pool, v_pool, slots, k, v)
    k.requires_grad_(True)
    kv_cache.write_slots(k_pool, v_pool, slots, k * 1, v.requires_grad_(True))
    for pool in (k_pool, v_pool):
        assert not pool.requires_grad and pool.grad_fn is None
    assert torch.equal(k_pool.cpu(), k_ref.cpu()) and torch.equal(v_pool.cpu(), v_ref.cpu())


def test_copy_blocks_copies_whole_blocks_of_one_pool():
    k_pool, v_pool = _pools(torch.float16)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    kv_cache.copy_blocks(k_pool, torch.tensor([0, 3]), torch.tensor([5, 1]))
    assert torch.equal(k_pool[5], k_before[0]) and torch.equal(k_pool[1], k_before[3])
    assert torch.equal(k_pool[2], k_before[2]) and torch.equal(v_pool, v_before)
    kv_cache.copy_blocks(k_pool, torch.tensor([], dtype=torch.long), torch.tensor([]))
    assert torch.equal(k_pool[2], k_before[2])


def test_copy_blocks_through_a_blocks_first_view_copies_every_layer():
    """The allocator's form: one view of all layers' K and V pools, blocks first."""
    kv = torch.randn(3, 2, 6, 4, 2, 8)  # layers, K/V, blocks, block_size, heads, dim
    before = kv.clone()
    kv_cache.copy_blocks(kv.transpose(0, 2), torch.tensor([0, 3]), torch.tensor([5, 1]))
    assert torch.equal(kv[:, :, 5], before[:, :, 0]) and torch.equal(kv[:, :, 1], before[:, :, 3])
    for kept in (0, 2, 3, 4):
        assert torch.equal(kv[:, :, kept], before[:, :, kept])


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_kernel_gpu_matches_cpu_path(dtype):
    k_pool, v_pool = _pools(dtype, num_blocks=64, block_size=16, heads=8, dim=128)
    slots = torch.randperm(64 * 16)[:300]
    k, v = _new_rows(300, dtype, heads=8, dim=128)
    k_ref, v_ref = _expected(k_pool, v_pool, slots, k, v)
    gpu_pools = k_pool.cuda(), v_pool.cuda()
    kv_cache.write_slots(*gpu_pools, slots.cuda(), k.cuda(), v.cuda())
    assert torch.equal(gpu_pools[0].cpu(), k_ref) and torch.equal(gpu_pools[1].cpu(), v_ref)
