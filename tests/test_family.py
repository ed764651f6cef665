"""tools.family: the generated trees and model shapes the planner is judged on (no GPU
needed): seeded, split into halves, every case consistent and within its limits, and run by
the bench."""
import numpy as np
import pytest
import torch

from flash_reasoning import reference
from flash_reasoning.tools import bench, cli, family


def cases(count=60, **kw):
    return family.family_cases("reasoning", count, limits=family.CPU, **kw)


def test_a_family_is_the_same_list_for_a_seed():
    assert cases(seed=3) == cases(seed=3)
    assert cases(seed=3) != cases(seed=4)


def test_the_halves_split_the_family():
    whole = cases()
    fit, held_out = cases(half="fit"), cases(half="held-out")
    assert fit + held_out != whole and sorted(fit + held_out, key=whole.index) == whole
    assert not {c["name"] for c in fit} & {c["name"] for c in held_out}
    assert len(fit) == len(held_out) == 30


@pytest.mark.parametrize("limits", [family.CPU, family.GPU], ids=["cpu", "gpu"])
def test_every_case_is_a_consistent_tree_within_its_limits(limits):
    generated = family.family_cases("reasoning", 100, seed=1, limits=limits)
    kinds = {c["name"].split("_")[0] for c in generated}
    assert kinds == {"parallel", "beam", "tree", "short", "random"}
    for case in generated:
        spec = bench.case_spec(case)
        assert (case["branches"], case["unique_tokens"], case["logical_tokens"]) == (
            spec.leaves().size, spec.unique_tokens, spec.logical_tokens)
        assert case["unique_tokens"] <= limits.max_unique_tokens
        assert case["logical_tokens"] <= limits.max_logical_tokens
        assert 1 <= case["branches"] <= limits.max_branches and (spec.seqlen >= 1).all()
        assert (case["num_qo_heads"], case["num_kv_heads"]) in family.MODEL_HEADS
        assert case["head_dim"] in family.HEAD_DIMS and case["dtype"] in family.DTYPES
    inside_a_page = [c for c in generated if (bench.case_spec(c).node_start() % 16).any()]
    assert len(inside_a_page) > len(generated) // 2


def test_beams_fork_near_the_end_of_one_chain():
    import random
    for seed in range(20):
        spec = family.beam_search(random.Random(seed), family.GPU)
        ends = (spec.node_start() + spec.seqlen)[spec.leaves()]
        assert 4 <= spec.leaves().size <= 32 and (ends == ends[0]).all()  # beams as long
        starts = spec.node_start()[spec.leaves()]
        assert (starts >= ends[0] - 64).all() and (starts >= 1).all()


def test_pruning_keeps_a_tree_of_at_most_the_leaves_asked():
    spec = family.random_tree(__import__("random").Random(0), family.GPU)
    pruned = family._pruned_to(spec, 7)
    assert pruned.leaves().size <= 7 and pruned.num_nodes < spec.num_nodes
    assert (pruned.parent < np.arange(pruned.num_nodes)).all()  # still each after its parent


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="unknown family 'x'"):
        family.family_cases("x", 4)
    with pytest.raises(ValueError, match="half must be one of"):
        family.family_cases("reasoning", 4, half="test")


def test_the_bench_runs_a_family_and_checks_each_op(capsys):
    for case in cases(count=5):
        rows = bench.run_case(case, bench.OPS, "cpu", 3, None)
        for row in rows:
            assert row.us > 0 and row.error < reference.TOLERANCE[getattr(torch, case["dtype"])]
    assert cli.main(["bench", "--device", "cpu", "--family", "reasoning", "--family-size", "4",
                     "--runs", "3"]) == 0
    out = capsys.readouterr().out
    assert "beam_search_1/" in out and "parallel_sampling_0/" not in out  # the held-out half
