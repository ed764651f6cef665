"""Writes into the paged KV pools: one new token per slot (append) and whole-block copies
(copy-on-write). The allocator decides *where* to write; this module only moves data.

A pool is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a *slot* is the flat token
index ``block_id * block_size + offset`` into it.
"""
from __future__ import annotations

import torch

from . import _core, runtime
from .ops.checks import check_compiled
from .runtime import Launch


def write_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, validate: bool = True) -> None:
    """Write ``k[i]``/``v[i]`` (``[num_kv_heads, head_dim]`` each) into token slot ``slots[i]``.

    One kernel launch on CUDA tensors (the AOT ``append_kv`` kernel), plain indexing on CPU.
    Values are copied: k/v that require grad leave the pools out of autograd.
    ``validate`` checks k/v against the pools and the slots (integers inside the pool, distinct:
    one sync); ``validate=False`` skips all of it, for a caller that guarantees them (the
    allocator's hot path).
    """
    if validate:
        _check_write(k_pool, v_pool, slots, k, v)
    if slots.numel() == 0:
        return
    if k_pool.is_cuda:
        _append_on_device(k_pool, v_pool, slots.to(torch.int64), _kernel_ready(k),
                          _kernel_ready(v))
        return
    num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    index = slots.to(torch.long)
    if k.requires_grad or v.requires_grad:  # a write copies values: never attach the pools to
        k, v = k.detach(), v.detach()       # autograd (the CUDA kernel reads raw pointers)
    k_pool.view(-1, num_kv_heads, head_dim)[index] = k
    v_pool.view(-1, num_kv_heads, head_dim)[index] = v


def _append_on_device(k_pool, v_pool, slots, k, v) -> None:
    """The C++ core's append_kv launch on torch's current stream."""
    index = k_pool.device.index
    runtime.context(index).append_kv(
        tuple(t.data_ptr() for t in (k_pool, v_pool, slots, k, v)), slots.numel(),
        k_pool.shape[2], k_pool.shape[3], runtime.current_raw_stream(index))


def append_launches(k_pool, v_pool, slots, k, v, arch: str) -> list[Launch]:
    """The ``append_kv`` launch the C++ core builds for ``arch`` (one program per token and
    chunk of its K/V row), over these tensors: for Triton's interpreter."""
    listed = runtime.host_context(arch, _core.HOST_ONLY_SMS).append_kv_launches(
        slots.numel(), k_pool.shape[2], k_pool.shape[3])
    pointers = dict(zip(_core.APPEND_KV_POINTERS, (k_pool, v_pool, slots, k, v)))
    return runtime.core_launches(listed, arch, pointers, None)


def copy_blocks(blocks: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """Copy whole blocks ``src_blocks[i] -> dst_blocks[i]`` of ``blocks``, indexed by block
    along dim 0: one pool, or the allocator's view of every layer's K and V pools with the block
    dim first (one gather and one scatter for all of them). Used for copy-on-write."""
    if src_blocks.numel() == 0:
        return
    src = src_blocks.to(device=blocks.device, dtype=torch.long)
    dst = dst_blocks.to(device=blocks.device, dtype=torch.long)
    blocks[dst] = blocks[src]


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` dense and as aligned as the append kernel was compiled for (a copy if not)."""
    t = t.contiguous()
    return t if t.data_ptr() % runtime.POINTER_ALIGN == 0 else t.clone()


def _check_write(k_pool, v_pool, slots, k, v) -> None:
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("slots", slots)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_pool.dim() != 4:
        raise ValueError(f"k_pool must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_pool.shape)}")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool differ: {tuple(k_pool.shape)} {k_pool.dtype} "
                         f"vs {tuple(v_pool.shape)} {v_pool.dtype}")
    if k_pool.is_cuda:  # the append kernel moves 16-bit words
        check_compiled("k_pool", k_pool.dtype)
    check_rows(k, v, (slots.numel(), k_pool.shape[2], k_pool.shape[3]), k_pool.dtype,
               k_pool.device)
    _check_slots(slots, k_pool)


def _check_slots(slots: torch.Tensor, k_pool: torch.Tensor) -> None:
    """Slots are distinct integer token slots of the pool: a wrong one would write outside
    it. Costs a sync on CUDA (the allocator's own calls skip it: ``validate=False``)."""
    if slots.device != k_pool.device:
        raise ValueError(f"slots are on {slots.device}, the pool on {k_pool.device}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"slots must be 1-D, got shape {tuple(slots.shape)}")
    if slots.numel() == 0:
        return
    capacity = k_pool.shape[0] * k_pool.shape[1]
    distinct = torch.unique(slots)
    low, high = distinct[[0, -1]].tolist()
    if low < 0 or high >= capacity:
        raise ValueError(f"slots must lie in [0, {capacity - 1}] (num_blocks * block_size), "
                         f"got [{low}, {high}]")
    if distinct.numel() != slots.numel():
        raise ValueError(f"slots must be distinct, got {slots.numel() - distinct.numel()} "
                         f"repeated")


def check_rows(k, v, expected: tuple[int, int, int], dtype: torch.dtype,
               device: torch.device) -> None:
    """K/V rows to write must be tensors of shape (tokens, num_kv_heads, head_dim) in the
    pool's dtype and on its device."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (tokens, num_kv_heads, "
                             f"head_dim), got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} (the pool's dtype), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} (the pool's device), got {t.device}")
