"""The ``flash-reasoning`` commands on CPU: what they print and write (bench also on a GPU)."""
import json

import pytest
import torch

import flash_reasoning
from conftest import gpu
from flash_reasoning import tuning_table
from flash_reasoning.tools import bench, cli, report


def test_info_lists_archs_kernels_and_dispatch(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    archs = flash_reasoning.available_archs()  # a GPU check builds its own arch only
    assert archs
    for arch in archs:
        assert f"{arch}: " in out
    for kernel in ("paged_decode", "tree_partial", "tree_final", "append_kv", "merge_splits"):
        assert f"    {kernel} (" in out
    assert "HEAD_DIM=128" in out
    for arch in archs:  # each arch says where its configs come from
        table = tuning_table.load(arch)
        source = "heuristics" if table is None else f"{table.source} ("
        assert f"dispatch {arch}: {source}" in out
    assert "C library: " in out and "libflash_reasoning.so (include " in out
    if not torch.cuda.is_available():
        assert "device: none" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU table runs where no GPU is")
def test_bench_without_gpu_runs_the_small_cpu_table(capsys, tmp_path):
    json_path, csv_path = tmp_path / "rows.json", tmp_path / "rows.csv"
    assert cli.main(["bench", "--runs", "3", "--json", str(json_path),
                     "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device found" in out
    data = json.loads(json_path.read_text())
    assert data["meta"]["device"].startswith("cpu")
    rows = data["rows"]
    batches = bench.CPU_SEED["batches"]
    assert [(r["case"], r["op"]) for r in rows] == [
        (f"seed_b{b}/q32kv8", op) for b in batches for op in bench.OPS]
    for row in rows:
        assert row["device"] == "cpu" and row["us"] > 0 and row["floor_us"] is None
        assert row["error"] < 2e-3, row  # every op against the float64 reference
    tree = [r for r in rows if r["op"] == "tree_attention"]
    assert tree[-1]["kv_bytes"] < tree[-1]["kv_separate_bytes"]  # sharing saves memory
    assert [r["kv_bytes"] for r in rows if r["op"] == "paged_decode"] == \
        [r["kv_separate_bytes"] for r in tree]
    assert csv_path.read_text().count("\n") == len(rows) + 1
    assert "tree_attention slower than paged_decode" in out


def test_bench_rejects_an_unknown_op(capsys):
    assert cli.main(["bench", "--ops", "tree_attention,flash"]) == 2
    assert "unknown --ops ['flash']" in capsys.readouterr().err


def test_seed_table_keeps_reference_times_and_adds_missing_batches():
    cases = bench.table_cases(bench.load_cases(), cpu=False)
    names = [c["name"] for c in cases]
    seeds = [f"seed_b{b}/q32kv8" for b in bench.SEED_BATCHES]
    assert names[:len(seeds)] == seeds and len(names) == len(set(names))
    by_name = {c["name"]: c for c in cases}
    assert by_name["seed_b256/q32kv8"]["h100_fasttree_us"] == 99.4
    assert "h100_fasttree_us" not in by_name["seed_b128/q32kv8"]  # not in the file
    assert by_name["seed_b128/q32kv8"]["unique_tokens"] == 2048 + 128 * 64


def test_level_case_counts_tokens_as_the_cases_file_does():
    """Every case of the shipped file rebuilt from its levels has the file's token counts."""
    for case in bench.load_cases()["cases"]:
        built = bench.level_case(case["name"], case["nodes_per_level"], case["tokens_per_level"],
                                 case["num_qo_heads"], case["num_kv_heads"], case["head_dim"],
                                 case["dtype"])
        for key in ("branches", "unique_tokens", "logical_tokens"):
            assert built[key] == case[key], (case["name"], key)


def test_plot_from_a_json_run_or_a_message_naming_the_extra(tmp_path, capsys):
    rows = [r for b in (1, 2) for r in bench.run_case(
        bench.seed_case(b, prefix=32, leaf=8), bench.OPS, "cpu", 3, None)]
    report.write_json(tmp_path / "rows.json", {"version": "x", "device": "cpu"}, rows)
    meta, back = report.read_json(tmp_path / "rows.json")
    assert meta["device"] == "cpu" and back == rows
    png = tmp_path / "p.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="flash-reasoning\\[plot\\]"):
            cli.main(["plot", str(tmp_path / "rows.json"), str(png)])
        return
    assert cli.main(["plot", str(tmp_path / "rows.json"), str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    assert set(report.seed_series(rows)) == set(bench.OPS)


@gpu
def test_bench_case_on_gpu_checks_every_op():
    rows = bench.run_case(bench.seed_case(16), bench.OPS, "cuda", 5, bench.Machine(3.0, 600, 4))
    assert [r.op for r in rows] == list(bench.OPS)
    for row in rows:
        assert row.device == "gpu" and row.us > 0 and row.roofline_us >= row.floor_us + 4 > 4
        assert row.error < 2e-3, row
    assert rows[0].kv_bytes < rows[0].kv_separate_bytes and rows[0].speedup > 1


def test_separate_copy_serves_paged_decode_and_masked_sdpa():
    """Branches of different lengths: SDPA needs its key mask, paged_decode the lengths."""
    from flash_reasoning import reference
    from flash_reasoning.allocator import PhysicalKVAllocator
    from flash_reasoning.tools.synthetic import random_branches
    alloc = PhysicalKVAllocator(64, 4, 2, 64, dtype=torch.float16, device="cpu")
    ids = random_branches(alloc, 6, max_depth=3, max_tokens=9, seed=3)
    assert len({alloc.length(b) for b in ids}) > 1
    separate = bench.Separate.from_tree(alloc, ids)
    assert separate.key_mask is not None
    q = torch.randn(len(ids), 4, 64).half()
    expected = reference.tree_attention(q, alloc, ids)
    for run in (separate.paged_decode, separate.sdpa):
        out = torch.full_like(q, float("nan"))
        assert reference.relative_error(run(q, out), expected) < reference.TOLERANCE[q.dtype]
