"""benchmarks/extend.py on CPU (--smoke): every op (the plan with q_lens, SDPA over copies,
paged decode per query row where no draft mask applies) against the float64 reference, and
the JSON written."""
import json

from conftest import load_benchmark


def test_smoke_run_checks_every_op(tmp_path):
    out = tmp_path / "extend.json"
    assert load_benchmark("extend").main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["extend_b3_n4", "extend_b2_n9", "verify_ft_1,2,64_k3",
                                         "draft_ft_1,2,64_k5"]
    for row in rows:
        masked = row["case"].startswith("draft")
        assert set(row["err"]) == {"tree", "sdpa"} | (set() if masked else {"decode_rows"})
        assert max(row["err"].values()) < 2e-3


def test_a_wrong_op_fails_the_run(monkeypatch):
    bench = load_benchmark("extend")
    ops = bench.ops
    monkeypatch.setattr(bench, "ops", lambda *args: {
        **ops(*args), "tree": lambda: ops(*args)["sdpa"]().roll(1, 0)})
    assert bench.main(["--smoke"]) == 1
