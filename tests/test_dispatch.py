"""dispatch: the rules (heuristic or from a tuning table) and the specs they can ask for."""
import json

import pytest

from flash_reasoning import dispatch, tuning_table
from flash_reasoning.specializations import DTYPES

ARCHS = ("sm80", "sm89", "sm90")
LENGTHS = (None, 0, 1, 16, 17, 22, 23, 32, 33, 64, 65, 90, 91, 5000)


@pytest.fixture
def no_tables(monkeypatch, tmp_path):
    """Dispatch with no shipped table and no override: the heuristics everywhere."""
    monkeypatch.setattr(tuning_table, "SHIPPED_DIR", tmp_path / "none")
    monkeypatch.delenv(tuning_table.ENV_VAR, raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def override(monkeypatch, tmp_path):
    """Point FLASH_REASONING_TUNING at a table written from ``rules``."""
    def use(rules, arch="sm90"):
        path = tmp_path / f"{arch}.json"
        tuning_table.write(path, arch, rules, {"device": "test"})
        monkeypatch.setenv(tuning_table.ENV_VAR, str(path))
        dispatch.reset()
        return path
    yield use
    monkeypatch.delenv(tuning_table.ENV_VAR, raising=False)
    dispatch.reset()


@pytest.mark.parametrize("tokens, expected", [
    (1, (16, 2, 1)), (16, (16, 2, 1)), (17, (32, 2, 2)), (32, (32, 2, 2)),
    (33, (32, 4, 2)), (64, (32, 4, 2)), (65, (64, 4, 2)), (4096, (64, 4, 2)),
    (None, (64, 4, 2))])
def test_heuristic_follows_the_longest_range(no_tables, tokens, expected):
    for kernel in ("paged_decode", "tree_final"):
        assert dispatch.config_for(kernel, "float16", 128, "sm90", tokens) == expected
    assert dispatch.config_for("tree_partial", "float16", 128, "sm90", tokens, 16) == expected


def test_heuristic_split_wide_tile_and_head_dim_256(no_tables):
    assert dispatch.config_for("paged_decode_split", "float16", 128, "sm90", 8) == (64, 4, 3)
    assert dispatch.config_for("tree_final", "bfloat16", 256, "sm90", 8) == (64, 8, 2)
    assert dispatch.config_for("tree_partial", "float16", 128, "sm90", 8, 64) == (64, 4, 3)
    assert dispatch.config_for("tree_partial", "float16", 128, "sm89", 8, 64) == (64, 4, 2)
    assert dispatch.config_for("tree_partial", "float16", 256, "sm89", 8, 64) == (64, 8, 1)
    assert dispatch.config_reason("tree_final", "float16", 128, "sm90", 40) == \
        "heuristic: range <= 64 tokens"


def test_a_table_replaces_the_heuristic_for_its_keys_only(override):
    path = override({"tree_final/float16/128": ((22, (16, 2, 1)), (None, (128, 4, 2)))})
    assert dispatch.config_for("tree_final", "float16", 128, "sm90", 22) == (16, 2, 1)
    assert dispatch.config_for("tree_final", "float16", 128, "sm90", 23) == (128, 4, 2)
    assert dispatch.config_for("tree_final", "float16", 128, "sm90", None) == (128, 4, 2)
    # The override replaces the shipped table whole: a key it lacks takes the heuristic.
    assert dispatch.config_for("tree_final", "bfloat16", 128, "sm90", 23) == (32, 2, 2)
    assert dispatch.config_reason("tree_final", "float16", 128, "sm90", 23).startswith(
        f"{tuning_table.ENV_VAR}={path}: range > 22 tokens")
    assert dispatch.tree_final_spec("float16", 128, "sm90").key["BLOCK_N"] == 128


def test_an_override_for_another_arch_leaves_this_one_alone(override, monkeypatch, tmp_path):
    monkeypatch.setattr(tuning_table, "SHIPPED_DIR", tmp_path / "none")
    override({"tree_final/float16/128": ((None, (128, 4, 2)),)}, arch="sm80")
    assert dispatch.config_for("tree_final", "float16", 128, "sm90", 100) == (64, 4, 2)
    assert dispatch.config_for("tree_final", "float16", 128, "sm80", 100) == (128, 4, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_config_a_call_can_pick_is_required(arch):
    dispatch.reset()
    required = set(dispatch.required_specs(arch))
    for dtype in DTYPES:
        for head_dim in dispatch.HEAD_DIMS:
            for tokens in LENGTHS:
                for kernel, block_m in dispatch.RULE_LISTS:
                    config = dispatch.config_for(kernel, dtype, head_dim, arch, tokens, block_m)
                    assert dispatch.kernel_spec(kernel, dtype, head_dim, arch, config,
                                                block_m) in required
            assert dispatch.decode_spec(dtype, head_dim, True, arch) in required
            assert dispatch.merge_spec(dtype, head_dim) in required


def test_required_specs_follow_the_table(override):
    override({"paged_decode/float16/64": ((None, (128, 8, 2)),)})
    spec = dispatch.decode_spec("float16", 64, False, "sm90", (128, 8, 2))
    assert spec in dispatch.required_specs("sm90")
    rules = dispatch.dispatch_rules("sm90")["rules"]
    assert rules["paged_decode/float16/64"] == [[None, spec.name]]


def test_exported_rules_drop_a_bound_where_the_next_rule_names_the_same_kernel(override):
    override({"tree_final/float16/64": ((16, (64, 4, 2)), (90, (32, 2, 2)), (200, (32, 2, 2)),
                                        (None, (64, 4, 2)))})
    named = dispatch.dispatch_rules("sm90")["rules"]["tree_final/float16/64"]
    assert [bound for bound, _ in named] == [16, 200, None]
    assert named[0][1] == named[2][1] != named[1][1]


@pytest.mark.parametrize("rules, match", [
    ([], "non-empty list"),
    ([[16, [16, 2, 1]]], "only the last null"),
    ([[None, [16, 2, 1]], [None, [32, 2, 2]]], "only the last null"),
    ([[32, [16, 2, 1]], [16, [16, 2, 1]], [None, [32, 2, 2]]], "ascending"),
    ([[0, [16, 2, 1]], [None, [32, 2, 2]]], "ascending positive"),
    ([[True, [16, 2, 1]], [None, [32, 2, 2]]], "ascending positive"),
    ([[None, [24, 2, 1]]], "power of two"),
    ([[None, [16, 2]]], "config must be"),
    ([[None, [16, 0, 1]]], "config must be"),
    ([[None, "16/2/1"]], "config must be"),
    ([[None]], r"must be \[bound"),
])
def test_a_bad_rule_list_is_rejected_naming_the_file(tmp_path, rules, match):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": 1, "arch": "sm90", "rules": {"tree_final/float16/128":
                                                                        rules}}))
    with pytest.raises(ValueError, match=match) as err:
        tuning_table.read(path)
    assert str(path) in str(err.value) and "tree_final/float16/128" in str(err.value)


@pytest.mark.parametrize("text, match", [("{", "cannot read"), ("[]", "schema"),
                                         ('{"schema": 2, "arch": "sm90", "rules": {}}', "schema"),
                                         ('{"schema": 1, "arch": 90, "rules": {}}', "arch")])
def test_a_file_that_is_no_table_is_rejected(tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        tuning_table.read(path)


def test_a_missing_override_says_which_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning_table.ENV_VAR, str(tmp_path / "missing.json"))
    dispatch.reset()
    try:
        with pytest.raises(ValueError, match=f"{tuning_table.ENV_VAR}=.*missing.json"):
            dispatch.config_for("tree_final", "float16", 128, "sm90", 8)
    finally:
        monkeypatch.delenv(tuning_table.ENV_VAR)
        dispatch.reset()


def test_an_unknown_kernel_has_no_rules():
    with pytest.raises(ValueError, match="no dispatch rules for kernel 'merge_splits'"):
        dispatch.rule_key("merge_splits", "float16", 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_shipped_tables_are_valid_and_name_their_arch(arch):
    table = tuning_table.load(arch)
    if table is not None:
        assert table.arch == arch and table.measured_on.get("device")
        keys = {dispatch.rule_key(k, d, h, b) for k, b in dispatch.RULE_LISTS for d in DTYPES
                for h in dispatch.HEAD_DIMS}
        assert set(table.rules) <= keys
