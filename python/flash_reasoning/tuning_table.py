"""Tuning tables: the measured dispatch rules of one arch, read from JSON.

``python -m flash_reasoning.tune`` times every compiled candidate on a GPU and writes a table;
the package ships one per measured arch in ``flash_reasoning/tuning/<arch>.json``. Setting
``FLASH_REASONING_TUNING`` to a table's path makes it replace the shipped table of its arch
(in Python dispatch; the C ABI follows the manifest, which the AOT build exports from the
tables present when it runs). An arch with no table uses the heuristics of ``dispatch``.

A table::

    {"schema": 1, "arch": "sm90",
     "measured_on": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-21", ...},
     "rules": {"tree_final/float16/128": [[16, [16, 2, 1]], [null, [64, 4, 2]]], ...}}

Each rule list maps ranges of at most ``bound`` tokens (``null``: any) to a (BLOCK_N,
num_warps, num_stages) config, as in ``dispatch.Rules``. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "FLASH_REASONING_TUNING"
SCHEMA = 1
SHIPPED_DIR = Path(__file__).resolve().parent / "tuning"

Config = tuple[int, int, int]
Rules = tuple[tuple[int | None, Config], ...]


@dataclass(frozen=True)
class Table:
    arch: str
    rules: dict[str, Rules]
    measured_on: dict
    source: str  # what dispatch's log names: the file, and whether it was the override


@functools.lru_cache(maxsize=None)
def load(arch: str) -> Table | None:
    """The table serving ``arch``: ``$FLASH_REASONING_TUNING`` when it names this arch, else
    the shipped one, else ``None``. A bad file raises ``ValueError`` naming it."""
    override = os.environ.get(ENV_VAR)
    if override:
        table = read(Path(override), f"{ENV_VAR}={override}")
        if table.arch == arch:
            return table
    shipped = SHIPPED_DIR / f"{arch}.json"
    return read(shipped, f"tuning table {shipped.name}") if shipped.exists() else None


def read(path: Path, source: str | None = None) -> Table:
    """Parse and check a table file (``source``: how dispatch names it, default the path)."""
    source = source or str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{source}: cannot read the tuning table: {err}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{source}: not a tuning table of schema {SCHEMA} (written by "
                         "python -m flash_reasoning.tune)")
    arch, rules = data.get("arch"), data.get("rules")
    if not isinstance(arch, str) or not isinstance(rules, dict):
        raise ValueError(f"{source}: needs a string 'arch' and an object 'rules'")
    parsed = {key: _rule_list(f"{source}: rules[{key!r}]", value) for key, value in rules.items()}
    return Table(arch, parsed, data.get("measured_on") or {}, source)


def _rule_list(where: str, value) -> Rules:
    """A checked rule list: bounds ascending positive ints ending with null, configs of three
    positive ints with a power-of-two BLOCK_N."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of [bound, [BLOCK_N, warps, stages]]")
    out, previous = [], 0
    for i, rule in enumerate(value):
        last = i == len(value) - 1
        if not (isinstance(rule, list) and len(rule) == 2):
            raise ValueError(f"{where}[{i}] must be [bound, [BLOCK_N, warps, stages]]")
        bound, config = rule
        if last != (bound is None) or (bound is not None and not (
                _is_int(bound) and bound > previous)):
            raise ValueError(f"{where}[{i}]: bounds must be ascending positive ints and only "
                             f"the last null, got {bound!r}")
        if not (isinstance(config, list) and len(config) == 3 and all(
                _is_int(c) and c > 0 for c in config)) or config[0] & (config[0] - 1):
            raise ValueError(f"{where}[{i}]: config must be [BLOCK_N (a power of two), "
                             f"num_warps, num_stages], got {config!r}")
        out.append((bound, tuple(config)))
        previous = bound or previous
    return tuple(out)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write(path: Path, arch: str, rules: dict[str, Rules], measured_on: dict) -> None:
    """Write a table that :func:`read` accepts (checked by reading it back)."""
    head = {"schema": SCHEMA, "arch": arch, "measured_on": measured_on}
    lines = [f" {json.dumps(key)}: {json.dumps([[b, list(c)] for b, c in rule_list])}"
             for key, rule_list in sorted(rules.items())]  # one rule list per line
    text = json.dumps(head)[:-1] + ',\n"rules": {\n' + ",\n".join(lines) + "\n}}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    read(path)
