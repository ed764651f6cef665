"""A bench run written out: JSON, CSV and the speedup/memory plot (matplotlib, optional)."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from .bench import Row


def write_json(path: str | Path, meta: dict, rows: list[Row]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]},
                                     indent=1) + "\n")


def read_json(path: str | Path) -> tuple[dict, list[Row]]:
    """What :func:`write_json` wrote: the run's metadata and its rows."""
    data = json.loads(Path(path).read_text())
    fields = Row.__dataclass_fields__
    return data["meta"], [Row(**{k: v for k, v in row.items() if k in fields})
                          for row in data["rows"]]


def write_csv(path: str | Path, rows: list[Row]) -> None:
    dicts = [r.to_dict() for r in rows]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dicts[0]) if dicts else ["case"])
        writer.writeheader()
        writer.writerows(dicts)


def require_matplotlib() -> None:
    """Fail before a long run, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("bench: --plot needs matplotlib: pip install 'flash-reasoning[plot]'"
                         ) from None


def seed_series(rows: list[Row]) -> dict[str, dict[int, Row]]:
    """The seed table's rows by op and batch (the q32kv8 layout the seed names)."""
    series: dict[str, dict[int, Row]] = {}
    for row in rows:
        match = re.fullmatch(r"seed_b(\d+)/q32kv8", row.case)
        if match and row.us is not None:
            series.setdefault(row.op, {})[int(match.group(1))] = row
    return series


def plot(path: str | Path, meta: dict, rows: list[Row]) -> None:
    """Speedup over paged_decode without sharing, and KV memory, against the batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = seed_series(rows)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for op, by_batch in sorted(series.items()):
        batches = sorted(by_batch)
        speed.plot(batches, [by_batch[b].speedup or float("nan") for b in batches], "o-",
                   label=op)
    tree = series.get("tree_attention", {})
    batches = sorted(tree)
    memory.plot(batches, [tree[b].kv_bytes / 2**20 for b in batches], "o-",
                label="tree (shared blocks)")
    memory.plot(batches, [tree[b].kv_separate_bytes / 2**20 for b in batches], "s--",
                label="each branch separately")
    for axis, title, unit in ((speed, "speedup over paged_decode without sharing", "x"),
                              (memory, "KV cache memory (one layer)", "MiB")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("branches (2048-token prompt, 64-token branches)")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    fig.suptitle(f"flash-reasoning {meta.get('version')} on {meta.get('device')} "
                 f"({meta.get('date')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
