"""FLASH_REASONING_LOG: the kernel configs chosen and why, logged at debug level only."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from flash_reasoning import TreeAttentionPlan, dispatch, log
from flash_reasoning.bench import case_allocator, seed_case
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.synthetic import paged_problem


def seed_plan(batch=16, prefix=256, leaf=64):
    """A root shared by ``batch`` leaves on CPU, planned for the H100 (as the interpreter
    tests do): a wide-tile partial for the root, the final kernel for the leaves."""
    alloc, leaves = case_allocator(seed_case(batch, prefix, leaf), device="cpu")
    return TreeAttentionPlan(alloc, leaves, 32, num_sms=132, arch="sm90")


def messages(caplog, kernel):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(kernel)]


def test_plan_logs_each_kernel_config_and_why(caplog):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    plan = seed_plan()
    final = messages(caplog, "tree_final")
    assert final == ["tree_final (sm90): decode_config(head_dim=128, max_tokens=64) -> "
                     "BLOCK_N 32, 4 warps, 2 stages (range <= 64 tokens)"]
    final_spec = plan._templates[-1][0]
    assert final_spec == dispatch.tree_final_spec("float16", 128, "sm90", (32, 4, 2))
    partial = messages(caplog, "tree_partial")
    assert len(partial) == len(plan._templates) - 1
    assert "block_m=64" in partial[0] and "wide tile" in partial[0]


def test_short_ranges_name_their_bound(caplog):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    seed_plan(batch=4, prefix=32, leaf=8)
    assert any("max_tokens=8) -> BLOCK_N 16, 2 warps, 1 stages (range <= 16 tokens)" in m
               for m in messages(caplog, "tree_final"))


@pytest.mark.parametrize("num_splits, reason", [(None, "split toward 2 programs per SM"),
                                                (3, "given by the caller")])
def test_paged_decode_logs_splits_and_config(caplog, num_splits, reason):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    p = paged_problem([2048, 1000], 8, 2, head_dim=128)
    decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, p.q.clone(), 0.1,
                    arch="sm90", num_sms=132, num_splits=num_splits)
    splits, config = messages(caplog, "paged_decode")
    assert reason in splits
    assert config.endswith("few_programs=True) -> BLOCK_N 64, 4 warps, 3 stages "
                           "(few programs (split): a deeper pipeline hides their latency)")


def test_a_given_config_is_not_explained_by_a_rule(caplog):
    caplog.set_level(logging.DEBUG, logger="flash_reasoning")
    p = paged_problem([40], 8, 2, head_dim=64)
    decode_launches(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, p.q.clone(), 0.1,
                    arch="sm90", num_sms=132, num_splits=1, config=(16, 2, 1))
    assert messages(caplog, "paged_decode")[-1].endswith("(given by the caller)")


def test_silent_and_unasked_by_default(caplog):
    caplog.set_level(logging.WARNING, logger="flash_reasoning")
    seed_plan()
    assert not log.enabled()
    assert not caplog.records


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
        from flash_reasoning.bench import case_allocator, seed_case
        alloc, leaves = case_allocator(seed_case(4, 64, 16), device="cpu")
        TreeAttentionPlan(alloc, leaves, 32, num_sms=132, arch="sm90")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "FLASH_REASONING_LOG": "debug"})
    assert result.returncode == 0, result.stderr
    assert "flash_reasoning DEBUG: tree_final (sm90): decode_config(" in result.stderr
