"""Runs kernel launches on a CUDA device through the C++ launcher and the AOT cubins.

A :class:`Launch` is data (spec, grid, args); this module turns tensors into raw pointers and
hands them to ``flash_reasoning._core`` on torch's current stream. It never imports triton
and never compiles: a device with no matching cubins gets a clear error.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .specializations import Spec

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
def _launcher_for(device_index: int):
    from . import _core
    arch_dir = artifact_root() / arch_of(device_index)
    launcher = _core.Launcher(str(arch_dir), device_index)  # validates the manifest
    _check_package_version(launcher.package_version, arch_dir / "manifest.json")
    return launcher


def _check_package_version(built_for: str, manifest: Path) -> None:
    """Cubins of another package version may take other arguments: refuse them."""
    from . import __version__
    if built_for != __version__:
        raise RuntimeError(f"{manifest} was built for flash_reasoning {built_for or None}, this "
                           f"is flash_reasoning {__version__}: rebuild the artifacts (pip "
                           f"install .) or point FLASH_REASONING_ARTIFACTS at this version's")


def run(launches: Sequence[Launch], device: torch.device) -> None:
    """Launch each in order on the current stream of ``device``; no sync, no allocation."""
    launcher = _launcher_for(device.index)
    stream = current_raw_stream(device.index)
    for launch in launches:
        launcher.launch(launch.spec.name, launch.grid, _raw_args(launch.args), stream)


def prepare(build: Callable[..., Sequence[Launch]], holes: Sequence[str], device: torch.device):
    """The launches ``build`` returns, converted and checked once by the launcher of
    ``device`` (a ``_core.PreparedLaunches``), for launches whose arguments stay fixed
    but for a few pointers. ``build`` is called with one placeholder per name in ``holes``,
    which it puts where that tensor goes; ``.run(pointers, stream)`` then fills them with
    ``pointers`` (data pointers in the order of ``holes``), checks each (non-null, aligned)
    and launches, without converting anything else again."""
    from . import _core
    launches = build(*(_core.Hole(i) for i in range(len(holes))))
    specs = [(launch.spec.name, launch.grid, _raw_args(launch.args))
             for launch in launches]  # _raw keeps the placeholders: they are not tensors
    return _launcher_for(device.index).prepare(specs, list(holes))


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
