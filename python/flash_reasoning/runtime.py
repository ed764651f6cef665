"""Runs kernel launches on a CUDA device through the C++ core and the AOT cubins.

The C++ core (``flash_reasoning._core``) builds each op's launches (the one place they are
made, for Python and the C ABI alike) and runs them on torch's current stream; this module holds
its per-device :func:`context`, turns the core's launch lists into :class:`Launch` records for
Triton's interpreter and the tuner, and launches such records. It never imports triton and never
compiles: a device with no matching cubins gets a clear error.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import dispatch, tuning_table
from .specializations import FAMILIES, Spec, make_spec

#: Pointer alignment the kernels were compiled for (``tt.divisibility`` 16 on every pointer).
POINTER_ALIGN = 16


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``args`` follow the spec's family params (tensor, int, float, None
    for a pointer the kernel does not touch in this specialization, or a :class:`TensorMap` for
    each of the spec's ``tensor_maps``)."""
    spec: Spec
    grid: tuple[int, int, int]
    args: tuple


@dataclass(frozen=True)
class TensorMap:
    """A pointer parameter the kernel reads through a TMA descriptor (``Spec.tensor_maps``):
    ``base`` (a tensor, or a placeholder for one) as a row-major ``[rows, cols]`` matrix. It
    fills the parameter and the :data:`~flash_reasoning.specializations.TENSOR_MAP_FIELDS`
    after it; the launcher encodes the descriptor at each launch from the pointer and those."""
    base: object
    rows: int
    cols: int

    def fields(self) -> tuple[int, int, int, int]:
        """The values of ``TENSOR_MAP_FIELDS``: the shape, then the strides (elements)."""
        return self.rows, self.cols, self.cols, 1


def artifact_root() -> Path:
    """The folder holding ``<arch>/manifest.json``; FLASH_REASONING_ARTIFACTS overrides."""
    override = os.environ.get("FLASH_REASONING_ARTIFACTS")
    return Path(override) if override else Path(__file__).resolve().parent / "_artifacts"


def load_manifest(arch: str) -> dict:
    """The AOT manifest of ``arch`` as data (the kernels compiled and their dispatch rules)."""
    return json.loads((artifact_root() / arch / "manifest.json").read_text())


def available_archs() -> list[str]:
    root = artifact_root()
    return sorted(p.parent.name for p in root.glob("*/manifest.json"))


def require_cuda(device: torch.device | int | None = None) -> torch.device:
    """The CUDA device to use; a clear error where there is none."""
    if not torch.cuda.is_available():
        raise RuntimeError("flash_reasoning: no CUDA device is available "
                           "(torch.cuda.is_available() is False). CPU tensors run the "
                           "PyTorch path; GPU kernels need an NVIDIA GPU of sm80 or newer.")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.device("cuda", device.index if device.index is not None
                        else torch.cuda.current_device())


def upload(array, device: torch.device) -> torch.Tensor:
    """``array`` (a host array) as a tensor on ``device``, without waiting for the device.

    A plain ``.to(device)`` from pageable memory synchronises the stream: the host then waits
    for every queued kernel before it plans the next step, and the GPU idles while it does
    (a decode loop's host work lands between its steps). Asynchronous, the driver stages the
    pageable bytes before the call returns, so the array may change or go at once. On the
    CPU the tensor shares the array's memory (``torch.from_numpy``)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


def upload_into(buffer: torch.Tensor, array) -> torch.Tensor:
    """:func:`upload` into an existing ``buffer`` (a CUDA graph's fixed input)."""
    return buffer.copy_(torch.from_numpy(array).view(buffer.shape), non_blocking=True)


@functools.lru_cache(maxsize=None)
def arch_of(device_index: int) -> str:
    """The compiled arch that serves this device (e.g. sm86 -> sm80)."""
    from . import _core
    major, minor = torch.cuda.get_device_capability(device_index)
    return _core.select_arch(major * 10 + minor, available_archs())


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def context(device_index: int):
    """The C++ core's context of a CUDA device: the kernels of the arch serving it and their
    dispatch rules (the manifest's, or ``$FLASH_REASONING_TUNING``'s table for that arch)."""
    from . import _core
    return _with_tuning_override(_core.Context(str(artifact_root()), device_index))


@functools.lru_cache(maxsize=None)
def host_context(arch: str, num_sms: int):
    """A context that plans and builds launches for ``arch`` on ``num_sms`` SMs without a GPU
    (CPU plans run through Triton's interpreter)."""
    from . import _core
    return _with_tuning_override(_core.Context.open_host_only(str(artifact_root()), arch, num_sms))


def _with_tuning_override(ctx):
    """``ctx`` picking by the tuning table ``$FLASH_REASONING_TUNING`` names, where it names
    ``ctx``'s arch: its rule lists replace the manifest's (which carries the rules of the
    tables present at build time); a list naming a kernel the artifacts lack is refused."""
    table = tuning_table.load(ctx.arch)
    if table is not None and table.source.startswith(tuning_table.ENV_VAR):
        ctx.override_rules(json.dumps(dispatch.dispatch_rules(ctx.arch, table.rules)))
    return ctx


def reset() -> None:
    """Forget the contexts and the rules they read (after ``$FLASH_REASONING_TUNING``
    changes)."""
    dispatch.reset()
    context.cache_clear()
    host_context.cache_clear()


def run(launches: Sequence[Launch], device: torch.device) -> None:
    """Launch each in order on the current stream of ``device``; no sync, no allocation."""
    ctx = context(device.index)
    stream = current_raw_stream(device.index)
    for launch in launches:
        ctx.launch(launch.spec.name, launch.grid, _raw_args(launch.args), stream)


@functools.lru_cache(maxsize=None)
def _manifest_specs(arch: str) -> dict[str, Spec]:
    specs = {}
    for entry in load_manifest(arch)["kernels"]:
        family, key = FAMILIES[entry["kernel"]], entry["key"]
        spec = make_spec(family, key["dtype"], key["num_warps"], key["num_stages"],
                         **{name: key[name] for name in family.constexprs})
        specs[spec.name] = spec
    return specs


def spec_of(arch: str, kernel_name: str) -> Spec:
    """The :class:`Spec` of a kernel of ``arch``'s manifest, by its name."""
    return _manifest_specs(arch)[kernel_name]


#: A workspace argument's element type, by its parameter's type.
_POINTER_DTYPES = {"*i32": torch.int32, "*i64": torch.int64, "*fp32": torch.float32}


def core_launches(listed: Sequence[tuple], arch: str, pointers: dict[str, object],
                  workspace: torch.Tensor | None) -> list[Launch]:
    """The C++ core's launch list (``(kernel, grid, args, ...)``, each arg ``(name, source,
    value, rows, cols)``: ``_core.TreePlan.launches``) as :class:`Launch` records: a per-call
    pointer is the tensor at its index in ``pointers`` (named in the core's order; a kernel
    may take one under another parameter's name, as ``tree_queries`` its pools' tensor maps),
    a workspace offset a view of ``workspace`` (uint8) typed as its parameter, a null pointer
    ``None``, and a pool the kernel reads through a TMA descriptor a :class:`TensorMap` of its
    view."""
    per_call = list(pointers.values())
    launches = []
    for kernel, grid, args, *_ in listed:
        spec = spec_of(arch, kernel)
        types = dict(FAMILIES[spec.family].params)
        values = []
        for name, source, value, rows, cols in args:
            if source == "call":
                arg = per_call[value]
            elif source == "workspace":
                arg = workspace[value:].view(_POINTER_DTYPES[types[name]])
            else:
                arg = None if types[name].startswith("*") and not value else value
            values.append(TensorMap(arg, rows, cols) if name in spec.tensor_maps else arg)
        launches.append(Launch(spec, tuple(grid), tuple(values)))
    return launches


def _raw_stream_getter() -> Callable[[int], int]:
    """device index -> the cudaStream_t of torch's current stream: the private call torch's
    own generated code uses costs 0.1 us on the H100 host, ``torch.cuda.current_stream()
    .cuda_stream`` 3.6 us (the fallback, for a torch without it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)


#: The cudaStream_t of torch's current stream on a device index (resolved once, at import).
current_raw_stream = _raw_stream_getter()


def _raw_args(args: Sequence) -> list:
    """The launcher's values of a launch's ``args``: one per kernel parameter, each
    :class:`TensorMap` spread over its parameter and the fields after it."""
    values = []
    for arg in args:
        if isinstance(arg, TensorMap):
            values += [_raw(arg.base), *arg.fields()]
        else:
            values.append(_raw(arg))
    return values


def _raw(arg):
    if isinstance(arg, torch.Tensor):
        ptr = arg.data_ptr()
        if ptr % POINTER_ALIGN:
            raise ValueError(f"tensor data pointer {ptr:#x} is not {POINTER_ALIGN}-byte aligned "
                             "(a view at an odd offset?); pass a contiguous copy")
        return ptr
    if arg is None:
        return 0
    return arg
