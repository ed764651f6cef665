"""benchmarks/extend.py on CPU (--smoke): every op (the plan with q_lens, SDPA over copies,
paged decode per query row) against the float64 reference, and the JSON written."""
import json

from conftest import load_benchmark


def test_smoke_run_checks_every_op(tmp_path):
    out = tmp_path / "extend.json"
    assert load_benchmark("extend").main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["extend_b3_n4", "extend_b2_n9", "verify_ft_1,2,64_k3"]
    for row in rows:
        assert set(row["err"]) == {"tree", "sdpa", "decode_rows"}
        assert max(row["err"].values()) < 2e-3


def test_a_wrong_op_fails_the_run(monkeypatch):
    bench = load_benchmark("extend")
    ops = bench.ops
    monkeypatch.setattr(bench, "ops", lambda *args: {
        **ops(*args), "tree": lambda: ops(*args)["decode_rows"]().roll(1, 0)})
    assert bench.main(["--smoke"]) == 1
