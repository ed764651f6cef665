"""The benchmark's floor and roofline and its summary of the tree-attention targets (no GPU
needed)."""
import json
import math

import pytest

from flash_reasoning.tools import bench


def row(case: str, us: float, floor: float, op: str = "tree_attention",
        speedup: float | None = None) -> bench.Row:
    return bench.Row(case, op, "gpu", us, floor, 0, 0, 0, 0, speedup=speedup)


def test_floor_is_the_unique_bytes_at_the_bandwidth():
    case = next(c for c in bench.load_cases()["cases"] if c["name"] == "seed_b256/q32kv8")
    # 18432 tokens x 8 heads x 128 x 2 B x (K, V), plus q and out: 256 x 32 heads x 128 x 2 B x 2
    assert bench.unique_bytes(case) == 18432 * 8 * 128 * 2 * 2 + 256 * 32 * 128 * 2 * 2
    assert bench.floor_us(case, 2.0) == pytest.approx(bench.unique_bytes(case) / 2e6)
    assert bench.floor_us(case, 4.0) == pytest.approx(bench.floor_us(case, 2.0) / 2)


def test_roofline_is_the_slower_of_bytes_and_flops_plus_a_launch():
    case = next(c for c in bench.load_cases()["cases"] if c["name"] == "seed_b256/q32kv8")
    # 256 branches of 2112 tokens, 32 query heads, each attending every token of its path.
    assert bench.attention_flops(case) == 4 * 128 * 32 * 256 * 2112
    memory_bound = bench.Machine(copy_bandwidth_tbps=2.0, matmul_tflops=1000.0, launch_us=4.0)
    assert bench.roofline_us(case, memory_bound) == pytest.approx(bench.floor_us(case, 2.0) + 4)
    compute_bound = bench.Machine(copy_bandwidth_tbps=2.0, matmul_tflops=1.0, launch_us=4.0)
    assert bench.roofline_us(case, compute_bound) == pytest.approx(
        bench.attention_flops(case) / 1e12 * 1e6 + 4)


def test_rows_carry_the_roofline_and_old_runs_read_without_it(tmp_path):
    from flash_reasoning.tools import report
    new = bench.Row("a/q32kv8", "tree_attention", "gpu", 30.0, 10.0, 0, 0, 0, 0,
                    roofline_us=20.0)
    assert new.over_roofline == 1.5 and new.to_dict()["over_roofline"] == 1.5
    assert "1.50" in bench.format_row(new)
    old = {k: v for k, v in new.to_dict().items() if "roofline" not in k}
    (tmp_path / "old.json").write_text(json.dumps({"meta": {}, "rows": [old]}))
    _, rows = report.read_json(tmp_path / "old.json")
    assert rows[0].roofline_us is None and rows[0].over_roofline is None
    assert "roofline" not in bench.summary(rows)


def test_summary_takes_each_target_over_its_own_cases():
    rows = [row("a/q32kv8", 20.0, 10.0), row("b/q32kv8", 80.0, 10.0),  # 2x and 8x: geomean 4x
            row("c/q32kv8", 9.0, 3.0),                                  # small: not in the mean
            row("d/q32kv32", 30.0, 20.0),
            row("e/q16kv1", 12.0, 1.0, speedup=0.9)]                    # small, slower
    text = bench.summary(rows)
    assert "q32kv8 (floor >= 10 us): geomean 4.00x floor over 2 cases, worst b/q32kv8 8.00x" in text
    assert "q32kv32 (floor >= 10 us): geomean 1.50x floor over 1 cases" in text
    assert "q16kv1 (floor >= 0 us): geomean 12.00x floor over 1 cases" in text
    assert "small cases (floor < 10 us): slowest e/q16kv1 12.0 us" in text
    assert "slower than paged_decode (no sharing) on 1 case(s): e/q16kv1" in text


def test_summary_gives_time_over_roofline_per_layout_and_over_all():
    rows = [row("a/q32kv8", 20.0, 10.0), row("b/q32kv8", 80.0, 10.0), row("d/q32kv32", 30.0, 20.0),
            row("e/q16kv1", 12.0, 1.0, op="paged_decode")]               # another op: not counted
    for r, roofline in zip(rows, (10.0, 10.0, 30.0, 1.0)):
        r.roofline_us = roofline
    text = bench.summary(rows)
    assert "q32kv8: geomean 4.00x roofline over 2 cases, worst b/q32kv8 8.00x" in text
    assert "tree_attention q32kv32: geomean 1.00x roofline over 1 cases" in text
    assert "tree_attention all cases: geomean 2.52x roofline over 3 cases, worst b/q32kv8" in text
    assert "q16kv1" not in text


def test_geomean():
    assert bench.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert bench.geomean([math.e]) == pytest.approx(math.e)
