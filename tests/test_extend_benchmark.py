"""benchmarks/extend.py on CPU (--smoke): every op (the plan with q_lens, SDPA over copies,
paged decode per query row) against the float64 reference, and the JSON written."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "extend.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("extend_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_checks_every_op(tmp_path):
    out = tmp_path / "extend.json"
    assert load_benchmark().main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["extend_b3_n4", "extend_b2_n9", "verify_ft_1,2,64_k3"]
    for row in rows:
        assert set(row["err"]) == {"tree", "sdpa", "decode_rows"}
        assert max(row["err"].values()) < 2e-3


def test_a_wrong_op_fails_the_run(monkeypatch):
    bench = load_benchmark()
    ops = bench.ops
    monkeypatch.setattr(bench, "ops", lambda *args: {
        **ops(*args), "tree": lambda: ops(*args)["decode_rows"]().roll(1, 0)})
    assert bench.main(["--smoke"]) == 1
