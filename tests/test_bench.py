"""The benchmark's floor and its summary of the tree-attention targets (no GPU needed)."""
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


def test_geomean():
    assert bench.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert bench.geomean([math.e]) == pytest.approx(math.e)
