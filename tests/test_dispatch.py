"""dispatch: the rules (heuristic or from a tuning table) and the specs they can ask for."""
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_reasoning import dispatch, tuning_table
from flash_reasoning.specializations import DTYPES, FAMILIES

ARCHS = ("sm80", "sm89", "sm90")
MEASURED_ARCHS = ("sm90",)  # the archs that ship a tuning table
LENGTHS = (None, 0, 1, 16, 17, 22, 23, 32, 33, 64, 65, 90, 91, 5000)
PROGRAMS = (None, 1, 264, 265, 1056, 1057, 100000)  # around 2 and 8 per SM of 132


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


def test_packed_final_programs_have_their_own_rules(no_tables):
    """Packed final programs (several branches each) take one config at any range; their
    spec says PACKED, and a tuning run finds their rule list from the spec."""
    for head_dim, tokens in itertools.product(dispatch.HEAD_DIMS, (8, 4096, None)):
        assert dispatch.config_for("tree_final_packed", "float16", head_dim, "sm90", tokens) == \
            dispatch.PACKED_FINAL_CONFIGS[head_dim]
    packed = dispatch.tree_final_spec("float16", 128, "sm90", packed=True)
    single = dispatch.tree_final_spec("float16", 128, "sm90")
    assert (packed.key["PACKED"], single.key["PACKED"]) == (1, 0) and packed.name != single.name
    assert (dispatch.rule_kernel(packed), dispatch.rule_kernel(single)) == \
        ("tree_final_packed", "tree_final")


def test_the_wide_final_tile_has_its_own_rules(no_tables):
    """The wide packed tile: its own rule list, a spec of FINAL_WIDE_BLOCK_M rows, a KV tile
    that holds a token of each lane at least (one lane per row at GQA group 1), and no
    unpacked form."""
    for head_dim in dispatch.HEAD_DIMS:
        config = dispatch.config_for("tree_final_packed_wide", "float16", head_dim, "sm90", 64)
        assert config == dispatch.PACKED_WIDE_FINAL_CONFIGS[head_dim]
        assert config[0] >= dispatch.FINAL_WIDE_BLOCK_M
        wide = dispatch.tree_final_spec("float16", head_dim, "sm90", packed=True, wide=True)
        assert wide.key["BLOCK_M"] == dispatch.FINAL_WIDE_BLOCK_M
        assert dispatch.rule_kernel(wide) == "tree_final_packed_wide"
    with pytest.raises(ValueError, match="packed"):
        dispatch.tree_final_spec("float16", 128, "sm90", wide=True)


def test_shared_range_programs_have_their_own_rules(no_tables):
    """Packed programs that first walk the range their lanes share: a rule list per final tile,
    specs that say COMMON and name their rule list back; no unpacked form."""
    for head_dim, wide in itertools.product(dispatch.HEAD_DIMS, (False, True)):
        kernel = dispatch.tree_final_kernel(True, wide, common=True)
        assert kernel == ("tree_final_common_wide" if wide else "tree_final_common")
        configs = dispatch.COMMON_WIDE_FINAL_CONFIGS if wide else dispatch.COMMON_FINAL_CONFIGS
        assert dispatch.config_for(kernel, "float16", head_dim, "sm90", 64) == configs[head_dim]
        spec = dispatch.tree_final_spec("float16", head_dim, "sm90", packed=True, wide=wide,
                                        common=True)
        assert (spec.key["COMMON"], spec.key["BLOCK_M"]) == (1, 32 if wide else 16)
        assert dispatch.rule_kernel(spec) == kernel
    with pytest.raises(ValueError, match="packed"):
        dispatch.tree_final_spec("float16", 128, "sm90", common=True)


def test_each_rule_lists_specs_name_it_back(no_tables):
    """rule_kernel inverts kernel_spec for every rule list (RULE_LIST_SPECS covers them)."""
    for kernel, block_m in dispatch.RULE_LISTS:
        spec = dispatch.kernel_spec(kernel, "float16", 128, "sm90", (32, 2, 2), block_m)
        assert dispatch.rule_kernel(spec) == kernel


def test_heuristic_split_wide_tile_and_head_dim_256(no_tables):
    assert dispatch.config_for("paged_decode_split", "float16", 128, "sm90", 8) == (64, 4, 3)
    assert dispatch.config_for("tree_final", "bfloat16", 256, "sm90", 8) == (64, 8, 2)
    assert dispatch.config_for("tree_partial", "float16", 128, "sm90", 8, 64) == (64, 4, 3)
    assert dispatch.config_for("tree_partial", "float16", 128, "sm89", 8, 64) == (64, 4, 2)
    assert dispatch.config_for("tree_partial", "float16", 256, "sm89", 8, 64) == (64, 8, 1)
    assert dispatch.config_reason("tree_final", "float16", 128, "sm90", 40) == \
        "heuristic: range <= 64 tokens"


def test_a_table_replaces_the_heuristic_for_its_keys_only(override):
    path = override({"tree_final/float16/128": ((None, 22, (16, 2, 1)), (None, None, (128, 4, 2)))})
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
    override({"tree_final/float16/128": ((None, None, (128, 4, 2)),)}, arch="sm80")
    assert dispatch.config_for("tree_final", "float16", 128, "sm90", 100) == (64, 4, 2)
    assert dispatch.config_for("tree_final", "float16", 128, "sm80", 100) == (128, 4, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_launches_overlap_the_partial_launch_on_sm90_only(arch):
    """Grid dependency control is sm90 PTX: the tree kernels of plans of several launches use it
    there only, and only they (each waits for the launch before it) are launched to overlap;
    tree_queries is a plan's one launch."""
    hopper = arch == "sm90"
    for spec in dispatch.required_specs(arch):
        waits = FAMILIES[spec.family].waits_for_previous
        assert waits == (spec.family in ("tree_partial", "tree_final", "tree_merge"))
        if waits:
            assert dict(spec.constexprs)["PDL"] == int(hopper), spec.name
        assert spec.overlaps_previous == (hopper and waits)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_config_a_call_can_pick_is_required(arch):
    dispatch.reset()
    required = set(dispatch.required_specs(arch))
    for dtype in DTYPES:
        for head_dim in dispatch.HEAD_DIMS:
            for tokens, programs in itertools.product(LENGTHS, PROGRAMS):
                for kernel, block_m in dispatch.RULE_LISTS:
                    for page_size, slot_runs in dispatch.addressings(kernel):
                        config = dispatch.config_for(kernel, dtype, head_dim, arch, tokens,
                                                     block_m, programs, 132, slot_runs)
                        assert dispatch.kernel_spec(kernel, dtype, head_dim, arch, config,
                                                    block_m, page_size, slot_runs) in required
            assert dispatch.decode_spec(dtype, head_dim, True, arch) in required
            assert dispatch.merge_spec(dtype, head_dim) in required


def assert_mirrored_rule_lists(rules, suffix, mark, generic_mark, lists_per_variant):
    """The manifest's rule lists ending in ``suffix`` (``lists_per_variant`` per dtype and
    head_dim) pick the configs of the lists without it: the same bounds, kernels named alike
    but for ``mark`` in place of ``generic_mark`` (and TMA descriptors where a slot-run walk
    reads through them)."""
    keys = [key for key in rules if key.endswith(suffix)]
    assert len(keys) == lists_per_variant * len(DTYPES) * len(dispatch.HEAD_DIMS)
    for key in keys:
        generic = rules[key.removesuffix(suffix)]
        assert [r[:2] for r in rules[key]] == [r[:2] for r in generic], key
        assert [r[2].replace(mark, generic_mark).replace("_tma1_", "_tma0_")
                for r in rules[key]] == [r[2].replace("_tma1_", "_tma0_") for r in generic], key


@pytest.mark.parametrize("arch", ARCHS)
def test_a_compiled_page_size_has_its_own_kernels_with_the_same_configs(arch):
    """Pools of a compiled page size get kernels with it as a constant, every other size the
    kernels that read it at run time; both rule lists pick the same configs."""
    assert dispatch.compiled_page(16) == 16 and 16 in dispatch.COMPILED_PAGE_SIZES
    for other in (1, 8, 32):
        assert dispatch.compiled_page(other) == 0
    assert dispatch.rule_key("tree_partial", "float16", 128, 64, 16) == \
        "tree_partial/float16/128/64/page16"
    assert dispatch.rule_key("paged_decode", "float16", 128, None, 8) == "paged_decode/float16/128"
    assert_mirrored_rule_lists(dispatch.dispatch_rules(arch)["rules"], "/page16", "_page16_",
                               "_page0_", len(dispatch.RULE_LISTS))
    assert dispatch.decode_spec("float16", 64, False, arch, None, 16).key["PAGE"] == 16
    assert dispatch.tree_final_spec("float16", 64, arch, None, True, 7).key["PAGE"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_run_partial_kernels_have_their_own_rules(arch, override):
    """tree_partial alone is also compiled to read ranges as one or two runs of slots, for any
    page size; their rule lists pick the configs of the page-size-at-run-time lists where the
    table has no list of their own."""
    override({}, arch)  # a table without the slot_runs lists (the shipped one may have some)
    assert dispatch.addressings("tree_partial") == ((0, 0), (16, 0), (0, 1), (0, 2))
    assert dispatch.addressings("tree_final") == ((0, 0), (16, 0))
    assert dispatch.rule_key("tree_partial", "float16", 128, 64, 16, 1) == \
        "tree_partial/float16/128/64/one_run"
    assert dispatch.rule_key("tree_partial", "float16", 128, 16, 0, 2) == \
        "tree_partial/float16/128/16/two_runs"
    with pytest.raises(ValueError, match="no slot-run kernels"):
        dispatch.rule_key("tree_final", "float16", 128, None, 0, 1)
    with pytest.raises(ValueError, match="no slot-run kernels"):
        dispatch.kernel_spec("paged_decode", "float16", 128, arch, (64, 4, 2), None, 0, 1)
    with pytest.raises(ValueError, match="no slot-run kernels read 3 runs"):
        dispatch.tree_partial_spec("float16", 128, 64, arch, None, 0, 3)
    for suffix, mark in (("/one_run", "_slot_runs1_"), ("/two_runs", "_slot_runs2_")):
        assert_mirrored_rule_lists(dispatch.dispatch_rules(arch)["rules"], suffix, mark,
                                   "_slot_runs0_", len(dispatch.TREE_BLOCK_MS))
    spec = dispatch.tree_partial_spec("float16", 64, 64, arch, None, 16, slot_runs=2)
    assert spec.key["SLOT_RUNS"] == 2 and spec.key["PAGE"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_only_sm90s_wide_slot_run_walk_reads_through_tensor_maps(arch):
    """TMA descriptors: the wide tile's slot-run walk at head_dim 128 and 256 on sm90, nothing
    else; such a spec takes its pools as tensor maps, each followed by its view's fields."""
    for dtype in DTYPES:
        for head_dim in dispatch.HEAD_DIMS:
            for block_m in dispatch.TREE_BLOCK_MS:
                for page_size, runs in dispatch.addressings("tree_partial"):
                    spec = dispatch.tree_partial_spec(dtype, head_dim, block_m, arch, None,
                                                      page_size, runs)
                    expected = (arch == "sm90" and runs > 0 and block_m == 64
                                and head_dim in (128, 256))
                    assert spec.key["TMA"] == expected
                    assert spec.tensor_maps == (("k_pool", "v_pool") if expected else ())
    if arch != "sm90":
        return
    spec = dispatch.tree_partial_spec("bfloat16", 128, 64, arch, (64, 4, 3), 16, 2)
    assert spec.signature()["k_pool"] == "tensordesc<bf16[64, 128]>"
    assert spec.tensor_map_tile() == (64, 128)
    params = spec.runtime_params()
    at = params.index(("k_pool", "nvTmaDesc"))
    assert params[at:at + 6] == [("k_pool", "nvTmaDesc"), ("k_pool_rows", "i32"),
                                 ("k_pool_cols", "i32"), ("k_pool_row_stride", "i64"),
                                 ("k_pool_col_stride", "i64"), ("v_pool", "nvTmaDesc")]
    assert len(params) == len(FAMILIES["tree_partial"].params) + 8


@pytest.mark.parametrize("key, parsed", [
    ("tree_final/float16/128", ("tree_final", "float16", 128, None, 0)),
    ("tree_partial/bfloat16/64/16", ("tree_partial", "bfloat16", 64, 16, 0)),
    ("tree_partial/float16/128/64/one_run", ("tree_partial", "float16", 128, 64, 1)),
    ("tree_partial/float16/256/16/two_runs", ("tree_partial", "float16", 256, 16, 2))])
def test_rule_keys_parse_back(key, parsed):
    assert dispatch.parse_rule_key(key) == parsed
    kernel, dtype, head_dim, block_m, runs = parsed
    assert dispatch.rule_key(kernel, dtype, head_dim, block_m, 0, runs) == key


def test_a_table_list_of_the_slot_run_kernels_serves_them_alone(override):
    """A tuning table's ``.../two_runs`` list picks the two-run kernels' configs; the page
    kernels' and the one-run kernels' keep theirs."""
    override({"tree_partial/float16/128/64/two_runs": ((None, None, (128, 8, 2)),)})
    assert dispatch.config_for("tree_partial", "float16", 128, "sm90", 1024, 64, 1000, 132,
                               2) == (128, 8, 2)
    for runs in (0, 1):
        assert dispatch.config_for("tree_partial", "float16", 128, "sm90", 1024, 64, 1000, 132,
                                   runs) == dispatch.config_for(
            "tree_partial", "float16", 128, "sm90", 1024, 64, 1000, 132) != (128, 8, 2)
    assert dispatch.config_reason("tree_partial", "float16", 128, "sm90", 1024, 64, 1000, 132,
                                  2).startswith(tuning_table.ENV_VAR)
    assert dispatch.tree_partial_spec("float16", 128, 64, "sm90", slot_runs=2) in \
        dispatch.required_specs("sm90")


def test_required_specs_follow_the_table(override):
    override({"paged_decode/float16/64": ((None, None, (128, 8, 2)),)})
    spec = dispatch.decode_spec("float16", 64, False, "sm90", (128, 8, 2))
    assert spec in dispatch.required_specs("sm90")
    rules = dispatch.dispatch_rules("sm90")["rules"]
    assert rules["paged_decode/float16/64"] == [[None, None, spec.name]]


def test_exported_rules_are_simplified(override):
    override({"tree_final/float16/64": (
        (2, 16, (64, 4, 2)), (2, 90, (32, 2, 2)), (2, 200, (32, 2, 2)), (2, None, (64, 4, 3)),
        (8, 16, (64, 4, 2)), (8, None, (32, 2, 2)),  # the same as the next band
        (None, 16, (64, 4, 2)), (None, None, (32, 2, 2)))})
    named = dispatch.dispatch_rules("sm90")["rules"]["tree_final/float16/64"]
    assert [rule[:2] for rule in named] == [[2, 16], [2, 200], [2, None], [None, 16],
                                            [None, None]]
    assert named[0][2] == named[3][2] != named[1][2] == named[4][2] != named[2][2]


PICKS = st.sampled_from([(16, 2, 1), (32, 2, 2)])  # two: bands often repeat one another
TOKEN_BOUNDS = (16, 64, 256)
BANDS = (0.5, 1, 2, 4, 8)


@st.composite
def rule_lists(draw):
    """Valid rule lists: ascending bands of ascending token bounds, each band's last open."""
    rules = []
    for band in sorted(draw(st.sets(st.sampled_from(BANDS), max_size=3))) + [None]:
        bounds = sorted(draw(st.sets(st.sampled_from(TOKEN_BOUNDS), max_size=2)))
        rules += [(band, b, draw(PICKS)) for b in bounds + [None]]
    return tuple(rules)


@settings(max_examples=300, deadline=None)
@given(rule_lists())
def test_simplified_rules_pick_as_the_rules_do(rule_list):
    tuning_table._rule_list("rules", [[p, b, list(c)] for p, b, c in rule_list])
    simple = tuning_table.simplify(rule_list)
    assert len(simple) <= len(rule_list)
    for tokens in [None, 1] + [b + d for b in TOKEN_BOUNDS for d in (0, 1)]:
        for programs in [None, 1] + [int(b * 132) + d for b in BANDS for d in (0, 1)]:
            assert dispatch.pick_rule(simple, tokens, programs, 132)[2] == \
                dispatch.pick_rule(rule_list, tokens, programs, 132)[2], (tokens, programs)


def test_programs_per_sm_pick_the_band():
    rule_list = ((1, None, (64, 4, 3)), (4, 64, (32, 4, 2)), (4, None, (64, 4, 2)),
                 (None, None, (32, 2, 2)))
    for programs, tokens, config in [(132, 5000, (64, 4, 3)), (133, 64, (32, 4, 2)),
                                     (528, 65, (64, 4, 2)), (529, 8, (32, 2, 2)),
                                     (None, 8, (32, 2, 2)), (1, None, (64, 4, 3)),
                                     (200, None, (64, 4, 2))]:
        assert dispatch.pick_rule(rule_list, tokens, programs, 132)[2] == config
    assert dispatch.pick_rule(rule_list, 8, 100, None)[2] == (32, 2, 2)  # SMs unknown: many


@pytest.mark.parametrize("rules, match", [
    ([], "non-empty list"),
    ([[None, 16, [16, 2, 1]]], "end with a rule for any launch"),
    ([[2, None, [16, 2, 1]]], "end with a rule for any launch"),
    ([[None, None, [16, 2, 1]], [None, None, [32, 2, 2]]], "ascend"),
    ([[None, 32, [16, 2, 1]], [None, 16, [16, 2, 1]], [None, None, [32, 2, 2]]], "ascend"),
    ([[4, None, [16, 2, 1]], [2, None, [16, 2, 1]], [None, None, [32, 2, 2]]], "ascend"),
    ([[None, 0, [16, 2, 1]], [None, None, [32, 2, 2]]], "positive"),
    ([[0, None, [16, 2, 1]], [None, None, [32, 2, 2]]], "positive"),
    ([[None, 1.5, [16, 2, 1]], [None, None, [32, 2, 2]]], "tokens an int"),
    ([[None, True, [16, 2, 1]], [None, None, [32, 2, 2]]], "positive"),
    ([[True, None, [16, 2, 1]], [None, None, [32, 2, 2]]], "positive"),
    ([[None, None, [24, 2, 1]]], "power of two"),
    ([[None, None, [16, 2]]], "config must be"),
    ([[None, None, [16, 0, 1]]], "config must be"),
    ([[None, None, "16/2/1"]], "config must be"),
    ([[None, [16, 2, 1]]], r"must be \[max_programs_per_sm"),
])
def test_a_bad_rule_list_is_rejected_naming_the_file(tmp_path, rules, match):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": 2, "arch": "sm90", "rules": {"tree_final/float16/128":
                                                                        rules}}))
    with pytest.raises(ValueError, match=match) as err:
        tuning_table.read(path)
    assert str(path) in str(err.value) and "tree_final/float16/128" in str(err.value)


@pytest.mark.parametrize("text, match", [("{", "cannot read"), ("[]", "schema"),
                                         ('{"schema": 1, "arch": "sm90", "rules": {}}',
                                          "found schema 1"),
                                         ('{"schema": 2, "arch": 90, "rules": {}}', "arch")])
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
def test_shipped_tables_are_valid_and_name_their_arch(arch, monkeypatch):
    monkeypatch.delenv(tuning_table.ENV_VAR, raising=False)
    dispatch.reset()
    table = tuning_table.load(arch)
    assert (table is not None) == (arch in MEASURED_ARCHS)  # the README says which
    if table is not None:
        assert table.arch == arch and table.measured_on.get("device")
        keys = {dispatch.rule_key(k, d, h, b, 0, runs) for k, b in dispatch.RULE_LISTS
                for d in DTYPES for h in dispatch.HEAD_DIMS for _, runs in dispatch.addressings(k)}
        assert set(table.rules) <= keys
