"""benchmarks/generation.py end to end on CPU (--smoke): every path runs, their greedy tokens
agree, the tree path stores the shared prompt once, and the JSON and figure are written."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port, load_benchmark

pytest.importorskip("transformers")


def test_smoke_run_writes_json_and_figure(tmp_path):
    bench = load_benchmark("generation")
    out, fig = tmp_path / "gen.json", tmp_path / "gen.png"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--smoke", "--json", str(out), "--figure", str(fig)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cpu" and report["meta"]["transformers"]
    assert [row["n"] for row in report["results"]] == [1, 3]
    for row in report["results"]:
        for path in bench.PATHS:
            assert row[path]["ok"] and row[path]["decode_tokens_per_s"] > 0, (path, row[path])
        assert row["tree_vs_transformers"]["identical"], row["tree_vs_transformers"]
        assert row["tree_vs_no_sharing"]["identical"], row["tree_vs_no_sharing"]
        # 11 decode steps, two windows of profiled ones (unprofiled on CPU) left out.
        assert row["tree"]["steps"] == 11 - 2 * bench.PROFILED_STEPS
    shared = report["results"][1]["tree"]["kv_memory"]
    copied = report["results"][1]["no_sharing"]["kv_memory"]
    assert shared["tokens_logical"] == copied["tokens_logical"]
    assert shared["tokens_physical"] < copied["tokens_physical"] == copied["tokens_logical"]
    if importlib.util.find_spec("matplotlib"):
        assert fig.stat().st_size > 0


def test_beam_search_benchmark_smoke_run(tmp_path):
    bench = load_benchmark("beam_search")
    out = tmp_path / "beam.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["results"]
    assert (row["prompt"], row["k"]) == (24, 3)
    for path in ("sample_graphs", "beam_paged_graphs", "beam_tree"):
        assert math.isfinite(row[f"{path}_ms_per_step"]), row


def test_covered_time_counts_overlapping_kernels_once():
    bench = load_benchmark("generation")

    class Kernel:  # a profiler event's time range, in us
        def __init__(self, start, end):
            self.time_range = type("Range", (), {"start": start, "end": end})

    spans = [(10, 20), (0, 5), (15, 30), (16, 18), (40, 41)]  # 0-5, 10-30, 40-41
    assert bench.covered_us([Kernel(*s) for s in spans]) == 26
    assert bench.covered_us([]) == 0


def test_profiled_steps_are_left_out_of_the_step_times():
    bench = load_benchmark("generation")
    steps = 127
    windows = bench.profile_windows(steps)
    median, last = sorted(windows)
    assert windows == {median: "median", last: "last"}
    assert median < steps // 2 < median + bench.PROFILED_STEPS <= last
    assert last + bench.PROFILED_STEPS == steps
    assert bench.profile_windows(2 * bench.PROFILED_STEPS) == {}
    # Marks in seconds (CPU): three 1 s steps, a profiled window (None), three 0.5 s steps;
    # the first two steps (eager, capture) are left out too.
    marks = [0.0, 1.0, 2.0, 3.0, None, 10.0, 10.5, 11.0, 11.5]
    stats = bench.step_stats(marks, 4, torch.device("cpu"))
    assert stats["steps"] == 6 and stats["step_ms_max"] == 1000.0
    assert stats["step_ms_median"] == 500.0
    assert stats["decode_tokens_per_s"] == pytest.approx(4 * 4 / 2.5)


@pytest.mark.parametrize("limit", [0, 1, 5, 100, 300, 1000])
def test_largest_n_finds_the_limit_from_any_listed_start(monkeypatch, limit):
    bench = load_benchmark("generation")
    probed = []

    def fake_guarded(fn, model, prompt, n, new_tokens, path):
        probed.append(n)
        return {"ok": n <= limit}, None

    monkeypatch.setattr(bench, "guarded", fake_guarded)
    found = bench.largest_n(None, None, 8, "tree", [8, 64, 256])
    assert found <= limit and (limit - found) <= max(1, found // 16), (found, probed)


def test_smoke_run_under_tensor_parallel_shards_the_cache(tmp_path):
    """Two CPU ranks (gloo) through torchrun: each rank's cache holds half the KV heads
    (half the bytes a token), and the paths' tokens still agree."""
    pytest.importorskip("accelerate")
    out = tmp_path / "gen.json"
    script = Path(__file__).parent.parent / "benchmarks" / "generation.py"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", str(script), "--smoke", "--tensor-parallel",
         "--json", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["meta"]["tensor_parallel"] == 2
    kv_heads, head_dim = 2, 64  # tiny-llama's, split over two ranks, float32
    for row in report["results"]:
        for path in ("tree", "no_sharing"):
            assert row[path]["kv_memory"]["bytes_per_token_per_layer"] == \
                2 * (kv_heads // 2) * head_dim * 4
        assert row["tree_vs_transformers"]["identical"], row["tree_vs_transformers"]
        assert row["tree_vs_no_sharing"]["identical"], row["tree_vs_no_sharing"]
