"""``flash-reasoning demo`` on the CPU: a checked run, a pool too small, bad options, the
check catching a wrong result, and determinism."""
import argparse
import re

import pytest

from flash_reasoning import reference
from flash_reasoning.tools import demo

SMALL = ["--steps", "6", "--prefix", "40", "--width", "6", "--expand", "3",
         "--expand-every", "2", "--layers", "2", "--device", "cpu"]


def run_demo(argv, capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    code = demo.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def step_rows(out):
    """Per-step lines split into columns: step, live, new, pruned, blocks used/total,
    tokens logical/physical, saved MiB, (saved %), [rel err], attention ms."""
    return [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s", line)]


def test_small_checked_run(capsys):
    code, out, err = run_demo(SMALL + ["--check"], capsys)
    assert code == 0, err
    rows = step_rows(out)
    assert [int(row[0]) for row in rows] == list(range(6))
    # The root forks 3, those fork 9 (3 pruned), then 18 (12 pruned): never above the width.
    assert [int(row[1]) for row in rows] == [3, 3, 6, 6, 6, 6]
    assert [(int(row[2]), int(row[3])) for row in rows[::2]] == [(3, 0), (9, 3), (18, 12)]
    for row in rows:
        used, total = map(int, row[4].split("/"))
        logical, physical = map(int, row[5].split("/"))
        assert 0 < used <= total
        assert logical > physical  # the children share the prompt
        assert float(row[6]) > 0 and float(row[7].strip("(%)")) > 0
        assert float(row[8]) < 2e-3
    assert "summary: 6 steps, 6 live branches" in out
    assert "check: passed" in out


def test_pool_too_small_names_the_option(capsys):
    code, out, err = run_demo(SMALL + ["--num-blocks", "4"], capsys)
    assert code == 1
    assert "--num-blocks" in err and "KV pool exhausted" in err
    assert "summary" not in out


@pytest.mark.parametrize("bad", [["--width", "0"], ["--head-dim", "96"], ["--steps", "x"],
                                 ["--dtype", "float64"], ["--num-blocks", "1"]])
def test_bad_option_is_an_argparse_error(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        run_demo(SMALL + bad, capsys)
    assert exc.value.code == 2


def test_heads_not_a_multiple_are_refused(capsys):
    code, out, err = run_demo(SMALL + ["--num-qo-heads", "6", "--num-kv-heads", "4"], capsys)
    assert code == 2 and "--num-kv-heads" in err and out == ""


def test_check_fails_on_a_wrong_result(capsys, monkeypatch):
    exact = reference.tree_attention
    monkeypatch.setattr(reference, "tree_attention", lambda *a, **kw: exact(*a, **kw) * 1.01)
    code, out, err = run_demo(SMALL + ["--check"], capsys)
    assert code == 1 and "check FAILED" in err and "check: passed" not in out


def without_timing(out):
    steps = [row[:-1] for row in step_rows(out)]
    rest = [line for line in out.splitlines()
            if not re.match(r"\s*\d+\s", line) and not line.startswith("attention time")]
    return steps, rest


def test_same_seed_same_output(capsys):
    first = without_timing(run_demo(SMALL + ["--seed", "3"], capsys)[1])
    second = without_timing(run_demo(SMALL + ["--seed", "3"], capsys)[1])
    other = without_timing(run_demo(SMALL + ["--seed", "4"], capsys)[1])
    assert first == second
    assert first != other  # the seed does reach the weights and the sampling
