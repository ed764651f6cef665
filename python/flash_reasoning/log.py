"""The package's logger: which kernel and config each call was given, and why.

``FLASH_REASONING_LOG=debug`` (any ``logging`` level name) sets the level of the
``flash_reasoning`` logger when this module is first imported and sends its records to
stderr; applications may configure the logger themselves instead. Off by default: call
sites guard with :func:`enabled`, so building a message costs nothing then.
"""
from __future__ import annotations

import logging
import os
import warnings

from . import dispatch

logger = logging.getLogger("flash_reasoning")
ENV_VAR = "FLASH_REASONING_LOG"


def level_from_env(value: str | None) -> int | None:
    """The logging level named by the variable's value (``debug``, ``INFO``, ``10``);
    ``None`` when unset or unknown (a typo must not break ``import``: it warns)."""
    if not value:
        return None
    level = int(value) if value.isdigit() else logging.getLevelName(value.upper())
    if isinstance(level, int):
        return level
    warnings.warn(f"{ENV_VAR}={value!r} is not a logging level (debug, info, warning, ...); "
                  "ignored", stacklevel=2)
    return None


def _configure_from_env() -> None:
    level = level_from_env(os.environ.get(ENV_VAR))
    if level is None:
        return
    logger.setLevel(level)
    if not logger.handlers:  # without one, Python's last-resort handler drops DEBUG records
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def enabled() -> bool:
    """Whether debug records are wanted: call sites test this before building one."""
    return logger.isEnabledFor(logging.DEBUG)


def kernel_picked(kernel_name: str, rule_key: str, max_tokens: int, programs: int,
                  num_sms: int, arch: str, given: bool = False) -> None:
    """One debug record: the kernel the C++ core's dispatch picked from rule list
    ``rule_key`` for a launch of ``programs`` programs on ``num_sms`` SMs, each of at most
    ``max_tokens`` tokens, its (BLOCK_N, warps, stages), and which rule gave it
    (``dispatch.config_reason``)."""
    from . import runtime
    spec = runtime.spec_of(arch, kernel_name)
    constexprs = dict(spec.constexprs)
    kernel, dtype, head_dim, block_m, slot_runs = dispatch.parse_rule_key(rule_key)
    inputs = f"{dtype}, head_dim={head_dim}, max_tokens={max_tokens}, programs={programs}, " \
             f"num_sms={num_sms}"
    inputs += f", block_m={block_m}" if block_m is not None else ""
    inputs += f", slot_runs={slot_runs}" if slot_runs else ""
    if given:
        reason = "given by the caller"
    elif kernel in dispatch.RULE_LIST_SPECS:
        reason = dispatch.config_reason(kernel, dtype, head_dim, arch, max_tokens, block_m,
                                        programs, num_sms, slot_runs)
    else:
        reason = "its one config"
    logger.debug("%s (%s): %s -> BLOCK_N %d, %d warps, %d stages (%s)", kernel, arch, inputs,
                 constexprs.get("BLOCK_N", 0), spec.num_warps, spec.num_stages, reason)


def splits_chosen(num_seqs: int, programs_per_seq: int, capacity: int, num_sms: int,
                  splits: int, given: bool) -> None:
    """One debug record: how many splits a paged decode takes, and why."""
    reason = "given by the caller" if given else dispatch.split_reason(
        num_seqs, programs_per_seq, capacity, num_sms, splits)
    logger.debug("paged_decode: num_splits(num_seqs=%d, programs_per_seq=%d, capacity=%d, "
                 "num_sms=%d) -> %d (%s)", num_seqs, programs_per_seq, capacity, num_sms, splits,
                 reason)


_configure_from_env()
