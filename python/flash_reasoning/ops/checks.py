"""Argument checks shared by the public ops and the allocator: each names the argument, what
was expected and what was given (TypeError for a wrong type or dtype, ValueError otherwise).
They run before any launch or state change."""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from .. import dispatch
from ..runtime import POINTER_ALIGN

# The kernels compute base-2 scores ``(q . k) * (sm_scale * log2 e)`` in float32 from float16 or
# bfloat16 q and K. A float16 product sum is at most ``head_dim * 65504**2`` in magnitude; a
# scale within :func:`max_scale` keeps every such score within half the float32 range, so the
# scores and their differences (the online softmax subtracts the running maximum) stay finite.
# bfloat16 inputs beyond float16's range can overflow ``q . k`` itself, whatever the scale.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT16_MAX = float(torch.finfo(torch.float16).max)
LOG2E = math.log2(math.e)


def as_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; bools and floats are refused, not converted."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_layer(layer, num_layers: int) -> int:
    layer = as_int("layer", layer)
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must lie in [0, {num_layers - 1}], got {layer}")
    return layer


def max_scale(head_dim: int) -> float:
    """The largest ``|sm_scale|`` accepted for ``head_dim``: ``FLOAT32_MAX / (2 * log2(e) *
    head_dim * 65504**2)`` (4.29e26 at head_dim 64, 1.07e26 at 256). The C ABI's
    ``check_shape`` computes the same double in the same order."""
    return FLOAT32_MAX / (2.0 * LOG2E * head_dim * FLOAT16_MAX * FLOAT16_MAX)


def check_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` for None, else a real number with
    ``|sm_scale| <= max_scale(head_dim)``. Zero (uniform weights) and negative scales are
    computed as written; a larger magnitude would make the kernels' float32 scores overflow
    and is refused."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got "
                        f"{type(sm_scale).__name__} {sm_scale!r}")
    scale, bound = float(sm_scale), max_scale(head_dim)
    if not abs(scale) <= bound:  # NaN fails too
        raise ValueError(f"sm_scale must be finite and at most {bound:.6g} in magnitude for "
                         f"head_dim {head_dim} (float32 scores q.k * sm_scale * log2(e) of "
                         f"float16 inputs must not overflow), got {sm_scale!r}")
    return scale


def check_compiled(name: str, dtype: torch.dtype, head_dim: int | None = None) -> None:
    """The kernels were compiled for ``dtype`` (and ``head_dim``); ``name`` says whose."""
    dispatch.check_dtype(str(dtype).removeprefix("torch."), name)
    if head_dim is not None:
        dispatch.check_head_dim(head_dim, name)


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device,
                 owner: str) -> None:
    """``t`` is a tensor of ``dtype`` on ``device`` (``owner`` says whose device that is),
    contiguous and, on CUDA, as aligned as the kernels were compiled for."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} ({owner}'s device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}")
    if t.is_cuda and t.data_ptr() % POINTER_ALIGN:
        raise ValueError(f"{name}'s data must be {POINTER_ALIGN}-byte aligned (the kernels "
                         f"assume it), got address {t.data_ptr():#x} (a view at an odd "
                         f"offset?); pass a copy")


def check_apart(q: torch.Tensor, out: torch.Tensor | None) -> None:
    """``out`` (like ``q``, both contiguous) shares no memory with ``q``: a program writes its
    rows of ``out`` while other programs, of its launch or an earlier one still running, may
    read theirs of ``q``."""
    if out is not None and apart_bytes(q, out) < q.nbytes:
        raise ValueError("out overlaps q (the kernels read q while they write out); pass a "
                         "separate out")


def apart_bytes(q: torch.Tensor, out: torch.Tensor) -> int:
    """How far apart two same-sized contiguous tensors start: they overlap below their size."""
    return abs(out.data_ptr() - q.data_ptr())


def check_q_lens(q_lens, lengths) -> np.ndarray:
    """Query tokens per branch: a sequence of ints, one per branch (``lengths``, their
    current lengths), each in ``[0, length]`` (a branch's queries are its last tokens) ->
    a read-only int64 array."""
    if isinstance(q_lens, torch.Tensor):
        q_lens = q_lens.cpu().numpy()
    if isinstance(q_lens, (str, bytes)) or not hasattr(q_lens, "__len__"):
        raise TypeError(f"q_lens must be a sequence of ints (one per branch), got "
                        f"{type(q_lens).__name__}")
    counts = np.asarray(q_lens) if isinstance(q_lens, np.ndarray) else None
    if counts is None or counts.dtype.kind not in "iu" or counts.ndim != 1:
        # Element by element, for the message naming the first bad one.
        counts = np.array([as_int(f"q_lens[{i}]", n) for i, n in enumerate(q_lens)],
                          dtype=np.int64).reshape(-1)
    counts = counts.astype(np.int64)
    if counts.size and counts.min() < 0:
        i = int(np.argmax(counts < 0))
        raise ValueError(f"q_lens[{i}] must be >= 0, got {int(counts[i])}")
    lengths = np.asarray(lengths, np.int64)
    if counts.size != lengths.size:
        raise ValueError(f"q_lens must hold one count per branch ({lengths.size}), got "
                         f"{counts.size}")
    beyond = counts > lengths
    if beyond.any():
        i = int(np.argmax(beyond))
        raise ValueError(f"q_lens[{i}] = {int(counts[i])} exceeds its branch's length "
                         f"{int(lengths[i])}: a branch's queries are its last tokens, written "
                         f"before the call")
    counts.flags.writeable = False
    return counts


def check_masks(mask, q_lens: np.ndarray, max_tokens: int) -> dict[int, np.ndarray]:
    """Draft masks: one entry per branch, ``None`` (causal) or a bool ``[q_lens[i],
    q_lens[i]]`` tensor or array (True: query ``j`` may attend new token ``k``) of at most
    ``max_tokens`` queries -> {branch index: bool array} of the masked branches."""
    if isinstance(mask, (str, bytes, torch.Tensor, np.ndarray)) or not hasattr(mask, "__len__"):
        raise TypeError(f"mask must be a sequence with one entry per branch (None or a bool "
                        f"[q_lens[i], q_lens[i]] tensor), got {type(mask).__name__}")
    if len(mask) != q_lens.size:
        raise ValueError(f"mask must hold one entry per branch ({q_lens.size}), got {len(mask)}")
    masks = {}
    for i, m in enumerate(mask):
        if m is None:
            continue
        if isinstance(m, torch.Tensor):
            m = m.detach().cpu().numpy()
        if not isinstance(m, np.ndarray) or m.dtype != np.bool_:
            raise TypeError(f"mask[{i}] must be a bool tensor or array, got "
                            f"{getattr(m, 'dtype', type(m).__name__)}")
        m = m.copy()  # the caller's may change; a plan keeps its own
        m.flags.writeable = False
        n = int(q_lens[i])
        if m.shape != (n, n):
            raise ValueError(f"mask[{i}] must be [q_lens[{i}], q_lens[{i}]] = [{n}, {n}], got "
                             f"{list(m.shape)}")
        if n > max_tokens:
            raise ValueError(f"mask[{i}] covers {n} queries; draft masks cover at most "
                             f"{max_tokens} (one 64-bit word per query)")
        masks[i] = m
    return masks
