"""FLASH_REASONING_LOG: the kernel configs chosen and why, logged at debug level only."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from flash_reasoning import TreeAttentionPlan, dispatch, log, runtime, tuning_table
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.planner import PlanOptions
from flash_reasoning.tools.bench import case_allocator, seed_case
from flash_reasoning.tools.synthetic import paged_problem


def seed_plan(batch=16, prefix=256, leaf=64):
    """A root shared by ``batch`` leaves on CPU, planned for the H100 (as the interpreter
    tests do): a wide-tile partial for the root, the final kernel for the leaves."""
    alloc, leaves = case_allocator(seed_case(batch, prefix, leaf), device="cpu")
    return TreeAttentionPlan(alloc, leaves, 32,
                             _options=PlanOptions(num_sms=132, arch="sm90", flat=False))


def messages(caplog, kernel):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(kernel)]


def expected_record(kernel, dtype, max_tokens, programs, block_m=None, arch="sm90",
                    head_dim=128, num_sms=132):
    """The record dispatch's rules give (heuristic or shipped table alike)."""
    launch = (max_tokens, block_m, programs, num_sms)
    n, w, s = dispatch.config_for(kernel, dtype, head_dim, arch, *launch)
    inputs = f"{dtype}, head_dim={head_dim}, max_tokens={max_tokens}, programs={programs}, " \
             f"num_sms={num_sms}"
    inputs += f", block_m={block_m}" if block_m else ""
    reason = dispatch.config_reason(kernel, dtype, head_dim, arch, *launch)
    return f"{kernel} ({arch}): {inputs} -> BLOCK_N {n}, {w} warps, {s} stages ({reason})"


def test_plan_logs_each_kernel_config_and_why(caplog):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    plan = seed_plan()
    programs = 16 * 8  # branches x KV heads (a GQA group of 4 fits one tile)
    assert messages(caplog, "tree_final") == [expected_record("tree_final", "float16", 64,
                                                              programs)]
    config = dispatch.config_for("tree_final", "float16", 128, "sm90", 64, None, programs, 132)
    assert launch_specs(plan)[-1] == dispatch.tree_final_spec("float16", 128, "sm90", config,
                                                             page_size=16)
    partial = messages(caplog, "tree_partial")
    assert len(partial) == len(plan.kernels) - 1
    assert "block_m=64" in partial[0]


def test_the_reason_names_the_rule_and_its_source(caplog, monkeypatch, tmp_path):
    path = tmp_path / "sm90.json"
    tuning_table.write(path, "sm90", {"tree_final/float16/128": (  # configs the build compiles
        (1, 12, (16, 2, 1)), (1, None, (64, 4, 3)), (None, None, (32, 4, 2)))}, {})
    monkeypatch.setenv(tuning_table.ENV_VAR, str(path))
    runtime.reset()
    try:
        caplog.set_level(logging.DEBUG, logger="flash_reasoning")
        seed_plan(batch=4, prefix=32, leaf=8)  # 4 x 8 programs
        assert messages(caplog, "tree_final")[-1].endswith(
            f"max_tokens=8, programs=32, num_sms=132 -> BLOCK_N 16, 2 warps, 1 stages "
            f"({tuning_table.ENV_VAR}={path}: programs <= 1 per SM, range <= 12 tokens)")
        seed_plan(batch=32, prefix=32, leaf=8)  # 256 programs: more than one per SM
        assert messages(caplog, "tree_final")[-1].endswith(
            f"BLOCK_N 32, 4 warps, 2 stages ({tuning_table.ENV_VAR}={path}: programs > 1 "
            "per SM)")
    finally:
        monkeypatch.delenv(tuning_table.ENV_VAR)
        runtime.reset()


@pytest.mark.parametrize("num_splits, reason", [(None, "split toward 2 programs per SM"),
                                                (3, "given by the caller")])
def test_paged_decode_logs_splits_and_config(caplog, num_splits, reason):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    p = paged_problem([2048, 1000], 8, 2, head_dim=128)
    decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, p.q.clone(), 0.1,
                    arch="sm90", num_sms=132, num_splits=num_splits)
    splits, config = messages(caplog, "paged_decode")
    assert reason in splits
    splits = num_splits or runtime.host_context("sm90", 132).paged_decode_launches(
        {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 128, "dtype": "float16",
         "block_size": p.k_pool.shape[1], "num_blocks": p.k_pool.shape[0], "sm_scale": 0.1},
        2, p.block_tables.shape[1], True)[1]
    tokens = -(-2048 // splits)
    assert config == expected_record("paged_decode_split", "float16", tokens, 2 * 2 * splits)


def test_a_given_config_is_not_explained_by_a_rule(caplog):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    p = paged_problem([40], 8, 2, head_dim=64)
    decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, p.q.clone(), 0.1,
                    arch="sm90", num_sms=132, num_splits=1, config=(16, 2, 1))
    assert messages(caplog, "paged_decode")[-1].endswith("(given by the caller)")


def test_silent_and_unasked_by_default(caplog, monkeypatch):
    """Below debug level no record is made, and no reason is even built (the call sites
    test ``enabled()`` first)."""
    caplog.set_level(logging.INFO, logger="flash_reasoning")

    def must_not_run(*args):
        raise AssertionError("a debug reason was built while debug is off")
    monkeypatch.setattr(dispatch, "config_reason", must_not_run)
    seed_plan()
    p = paged_problem([64], 8, 2, head_dim=64)
    decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, p.q.clone(), 0.1,
                    arch="sm90", num_sms=132)
    assert not log.enabled()
    assert not caplog.records


def test_the_level_is_off_in_a_fresh_process_without_the_variable():
    env = {k: v for k, v in os.environ.items() if k != log.ENV_VAR}
    code = "from flash_reasoning import log; print(log.enabled(), log.logger.level)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env)
    assert result.stdout.split() == ["False", "0"], result.stderr


@pytest.mark.parametrize("value, level", [("debug", logging.DEBUG), ("INFO", logging.INFO),
                                          ("10", 10), ("", None), (None, None)])
def test_level_from_env(value, level):
    assert log.level_from_env(value) == level


def test_unknown_level_warns_instead_of_failing():
    with pytest.warns(UserWarning, match="FLASH_REASONING_LOG='loud'"):
        assert log.level_from_env("loud") is None


def test_env_var_sends_records_to_stderr():
    code = textwrap.dedent("""
        from flash_reasoning import TreeAttentionPlan
        from flash_reasoning.planner import PlanOptions
        from flash_reasoning.tools.bench import case_allocator, seed_case
        alloc, leaves = case_allocator(seed_case(4, 64, 16), device="cpu")
        TreeAttentionPlan(alloc, leaves, 32, _options=PlanOptions(num_sms=132, arch="sm90"))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "FLASH_REASONING_LOG": "debug"})
    assert result.returncode == 0, result.stderr
    # Four unshared branches of 80 tokens: no partials, the plan is a paged decode.
    assert "flash_reasoning DEBUG: paged_decode (sm90): float16, head_dim=128, max_tokens=80" \
        in result.stderr


def launch_specs(plan):
    """The Spec of each of a plan's launches (its kernels by manifest name)."""
    return [runtime.spec_of(plan.arch, name) for name in plan.kernels]
