"""Run :class:`flash_reasoning.runtime.Launch` lists through Triton's interpreter on CPU.

The same launches the C++ launcher runs on a GPU, so CPU CI exercises the real kernel
sources and the Python code that builds their arguments. TRITON_INTERPRET=1 must be set
before triton is first imported (tests/conftest.py does it).
"""
from __future__ import annotations

import os

import torch

from flash_reasoning.runtime import Launch, TensorMap
from flash_reasoning.specializations import FAMILIES

_WORD_DTYPES = {"*i16": torch.int16, "*i32": torch.int32, "*i64": torch.int64,
                "*fp32": torch.float32}


def run_interpreted(launches: list[Launch]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton")
    from .kernels import JIT_FUNCTIONS
    _widen_bf16_dot_operands()
    for launch in launches:
        JIT_FUNCTIONS[launch.spec.family][launch.grid](*triton_args(launch),
                                                       **dict(launch.spec.constexprs))


def triton_args(launch: Launch) -> list:
    """``launch``'s arguments as a Triton call of its kernel takes them (the interpreter's or a
    JIT compile's): each :class:`TensorMap` a Triton tensor descriptor over its view, tiled as
    the spec's loads are."""
    signature = launch.spec.signature()
    names = FAMILIES[launch.spec.family].param_names
    return [_interpreter_arg(a, signature[n], launch) for a, n in zip(launch.args, names)]


def _interpreter_arg(arg, typ: str, launch: Launch):
    if isinstance(arg, TensorMap):
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(arg.base.view(arg.rows, arg.cols), [arg.rows, arg.cols],
                                [arg.cols, 1], list(launch.spec.tensor_map_tile()))
    if not typ.startswith("*"):
        return arg
    if arg is None:  # a pointer this specialization never touches
        return torch.empty(1, dtype=_WORD_DTYPES.get(typ, torch.float16))
    if typ == "*i16":  # 16-bit word copies of fp16/bf16 data
        return arg.view(torch.int16)
    return arg


def _widen_bf16_dot_operands() -> None:
    """Triton 3.6's interpreter stores bf16 as uint16 and multiplies those integers in
    ``tl.dot``; widen bf16 operands to fp32 first (exact) so bf16 kernels can be checked."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *rest):
        return original(self, widen(a), widen(b), d, *rest)

    create_dot.widens_bf16 = True
    builder.create_dot = create_dot
