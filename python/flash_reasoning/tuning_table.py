"""Tuning tables: the measured dispatch rules of one arch, read from JSON.

``python -m flash_reasoning.tools.tune`` times every compiled candidate on a GPU and writes a table;
the package ships one per measured arch in ``flash_reasoning/tuning/<arch>.json``. Setting
``FLASH_REASONING_TUNING`` to a table's path makes it replace the shipped table of its arch
(in Python dispatch; the C ABI follows the manifest, which the AOT build exports from the
tables present when it runs). An arch with no table uses the heuristics of ``dispatch``.

A table::

    {"schema": 2, "arch": "sm90",
     "measured_on": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-21", ...},
     "rules": {"tree_final/float16/128": [[2, 90, [32, 4, 2]], [2, null, [64, 4, 3]],
                                          [null, 22, [16, 2, 1]], [null, null, [32, 2, 2]]], ...}}

A rule ``[max_programs_per_sm, max_tokens, [BLOCK_N, num_warps, num_stages]]`` serves a launch
of at most ``max_programs_per_sm x num_sms`` programs each walking at most ``max_tokens`` tokens
(``null``: any); the first rule that serves a launch gives its config. Rules ascend by programs
per SM, then by tokens, and the last serves any launch. Nothing here imports torch.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "FLASH_REASONING_TUNING"
SCHEMA = 2
SHIPPED_DIR = Path(__file__).resolve().parent / "tuning"

Config = tuple[int, int, int]
#: (max programs per SM, max tokens per program, config); ``None``: any.
Rule = tuple[float | None, int | None, Config]
Rules = tuple[Rule, ...]


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
        found = data.get("schema") if isinstance(data, dict) else None
        raise ValueError(f"{source}: not a tuning table of schema {SCHEMA} (found schema "
                         f"{found!r}); write one with python -m flash_reasoning.tools.tune")
    arch, rules = data.get("arch"), data.get("rules")
    if not isinstance(arch, str) or not isinstance(rules, dict):
        raise ValueError(f"{source}: needs a string 'arch' and an object 'rules'")
    parsed = {key: _rule_list(f"{source}: rules[{key!r}]", value) for key, value in rules.items()}
    return Table(arch, parsed, data.get("measured_on") or {}, source)


def _rule_list(where: str, value) -> Rules:
    """A checked rule list: positive bounds (programs per SM a number, tokens an int)
    ascending by (programs per SM, tokens), the last rule ``[null, null, config]``; configs
    of three positive ints with a power-of-two BLOCK_N."""
    shape = "[max_programs_per_sm, max_tokens, [BLOCK_N, warps, stages]]"
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {shape}")
    out = []
    for i, rule in enumerate(value):
        if not (isinstance(rule, list) and len(rule) == 3):
            raise ValueError(f"{where}[{i}] must be {shape}, got {rule!r}")
        per_sm, tokens, config = rule
        if not (per_sm is None or (_is_number(per_sm) and per_sm > 0)) or \
                not (tokens is None or (_is_int(tokens) and tokens > 0)):
            raise ValueError(f"{where}[{i}]: bounds must be null or positive (programs per SM "
                             f"a number, tokens an int), got {per_sm!r}, {tokens!r}")
        if not (isinstance(config, list) and len(config) == 3 and all(
                _is_int(c) and c > 0 for c in config)) or config[0] & (config[0] - 1):
            raise ValueError(f"{where}[{i}]: config must be [BLOCK_N (a power of two), "
                             f"num_warps, num_stages], got {config!r}")
        if out and _order(out[-1]) >= _order((per_sm, tokens)):
            raise ValueError(f"{where}[{i}]: rules must ascend by programs per SM, then by "
                             f"tokens; {rule[:2]} follows {list(out[-1][:2])}")
        out.append((per_sm, tokens, tuple(config)))
    if out[-1][:2] != (None, None):
        raise ValueError(f"{where} must end with a rule for any launch: [null, null, config]")
    return tuple(out)


def _order(rule) -> tuple[float, float]:
    per_sm, tokens = rule[:2]
    return (math.inf if per_sm is None else per_sm, math.inf if tokens is None else tokens)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def simplify(rules: tuple) -> tuple:
    """The same choices in fewer rules (of configs, or of anything a rule gives): a rule
    whose next rule in its band gives the same is dropped (the next one's bound covers it), and
    a band whose rules equal the next band's is dropped (its launches fall through to it)."""
    bands: list[list] = []
    for rule in rules:
        if bands and bands[-1][0][0] == rule[0]:
            bands[-1].append(rule)
        else:
            bands.append([rule])
    bands = [[r for r, after in zip(band, band[1:] + [None]) if after is None or after[2] != r[2]]
             for band in bands]
    kept = [band for band, after in zip(bands, bands[1:] + [None])
            if after is None or [r[1:] for r in band] != [r[1:] for r in after]]
    return tuple(rule for band in kept for rule in band)


def write(path: Path, arch: str, rules: dict[str, Rules], measured_on: dict) -> None:
    """Write a table that :func:`read` accepts (checked by reading it back)."""
    head = {"schema": SCHEMA, "arch": arch, "measured_on": measured_on}
    lines = [f" {json.dumps(key)}: {json.dumps([[p, t, list(c)] for p, t, c in rule_list])}"
             for key, rule_list in sorted(rules.items())]  # one rule list per line
    text = json.dumps(head)[:-1] + ',\n"rules": {\n' + ",\n".join(lines) + "\n}}\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    read(path)
