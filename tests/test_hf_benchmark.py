"""benchmarks/generation.py end to end on CPU (--smoke): every path runs, their greedy tokens
agree, the tree path stores the shared prompt once, and the JSON and figure are written."""
import importlib.util
import json

import pytest
import torch

from conftest import load_benchmark

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
    shared = report["results"][1]["tree"]["kv_memory"]
    copied = report["results"][1]["no_sharing"]["kv_memory"]
    assert shared["tokens_logical"] == copied["tokens_logical"]
    assert shared["tokens_physical"] < copied["tokens_physical"] == copied["tokens_logical"]
    if importlib.util.find_spec("matplotlib"):
        assert fig.stat().st_size > 0
