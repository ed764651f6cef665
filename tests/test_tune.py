"""The tuner's choices from timings (pure), its table output, and its GPU run."""
import gzip
import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpu
from flash_reasoning import dispatch, tuning_table
from flash_reasoning.tools import tune

CONFIGS = [(16, 2, 1), (32, 2, 2), (64, 4, 2), (128, 8, 2)]


@pytest.mark.parametrize("tokens, bucket", [(0, 1), (1, 1), (5, 4), (6, 8), (11, 8), (12, 16),
                                            (64, 64), (90, 64), (91, 128), (2896, 2048),
                                            (2897, 4096)])
def test_bucket_is_the_nearest_power_of_two_in_log_scale(tokens, bucket):
    assert tune.bucket_of(tokens) == bucket


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 14).map(lambda e: 2 ** e), st.sampled_from(CONFIGS),
                       min_size=1), st.integers(0, 40000))
def test_rules_serve_each_length_with_its_nearest_buckets_winner(winners, tokens):
    rules = tune.band_rules(None, winners)
    tuning_table._rule_list("rules", [[p, b, list(c)] for p, b, c in rules])  # valid
    nearest = min(winners, key=lambda b: (abs(math.log(b) - math.log(max(tokens, 1))), b))
    config = dispatch.pick_rule(rules, tokens)[2]
    assert config == winners[nearest] or _tie(winners, tokens, config)


def _tie(winners, tokens, config):
    """At a geometric midpoint both neighbours are nearest; the rules give the lower one."""
    distance = {b: abs(math.log(b) - math.log(max(tokens, 1))) for b in winners}
    best = min(distance.values())
    return any(winners[b] == config and math.isclose(d, best, rel_tol=1e-3, abs_tol=1e-3)
               for b, d in distance.items())


def sample(workload, tokens, config, us, key="tree_final/float16/128", programs=64):
    return tune.Sample(key, workload, tokens, programs, config, us)


def choose(samples, bands=()):
    return tune.choose(samples, 132, bands)


def test_each_bucket_takes_the_config_fastest_relative_to_each_workload():
    samples = [  # bucket 64: (32,2,2) is 10% faster on a, 50% slower on b: (64,4,2) wins
        sample("a", 60, (32, 2, 2), 10.0), sample("a", 60, (64, 4, 2), 11.0),
        sample("b", 70, (32, 2, 2), 300.0), sample("b", 70, (64, 4, 2), 200.0),
        sample("c", 1000, (32, 2, 2), 50.0), sample("c", 1000, (64, 4, 2), 40.0),
        sample("d", 8, (32, 2, 2), 5.0), sample("d", 8, (64, 4, 2), 6.0)]
    rules = choose(samples)["tree_final/float16/128"]
    assert rules == ((None, 22, (32, 2, 2)), (None, None, (64, 4, 2)))


def test_many_short_workloads_outvote_one_long_one():
    samples = [sample(w, 64, (32, 2, 2), 10.0) for w in "abc"] + \
        [sample(w, 64, (64, 4, 2), 11.0) for w in "abc"] + \
        [sample("long", 64, (32, 2, 2), 300.0), sample("long", 64, (64, 4, 2), 280.0)]
    assert choose(samples)["tree_final/float16/128"] == ((None, None, (32, 2, 2)),)


def test_each_band_of_programs_per_sm_takes_its_own_winners():
    few = [sample("few", 128, (64, 4, 3), 10.0, programs=128),
           sample("few", 128, (32, 2, 2), 13.0, programs=128)]
    many = [sample("many", 128, (64, 4, 3), 60.0, programs=8192),
            sample("many", 128, (32, 2, 2), 50.0, programs=8192)]
    assert choose(few + many, bands=(2, 8))["tree_final/float16/128"] == \
        ((2, None, (64, 4, 3)), (None, None, (32, 2, 2)))
    # One band: the geometric mean of both workloads' ratios picks one config for all.
    assert choose(few + many)["tree_final/float16/128"] == ((None, None, (64, 4, 3)),)
    # The last band measured serves any count; bands with one winner merge.
    assert choose(few, bands=(2, 8))["tree_final/float16/128"] == ((None, None, (64, 4, 3)),)
    assert choose(few + [replace(s, config=c) for s, c in zip(many, [(32, 2, 2), (64, 4, 3)])],
                  bands=(2, 8))["tree_final/float16/128"] == ((None, None, (64, 4, 3)),)


def test_a_launch_at_a_band_edge_belongs_to_that_band():
    edge = sample("a", 8, (16, 2, 1), 1.0, programs=264)
    assert edge.band(132, (2, 8)) == 2 and replace(edge, programs=265).band(132, (2, 8)) == 8
    assert replace(edge, programs=1057).band(132, (2, 8)) is None


@pytest.mark.parametrize("name", ["raw.json", "raw.json.gz"])
def test_the_table_can_be_chosen_again_from_raw_timings(tmp_path, name):
    samples = [sample("a", 8, (16, 2, 1), 5.0), sample("a", 8, (64, 4, 2), 7.0),
               sample("b", 512, (16, 2, 1), 90.0), sample("b", 512, (64, 4, 2), 60.0),
               sample("c", 8, (16, 2, 1), 9.0, programs=4000),
               sample("c", 8, (64, 4, 2), 7.0, programs=4000)]
    raw = tmp_path / name
    text = json.dumps({"measured_on": {"arch": "sm90", "device": "x", "num_sms": 132},
                       "samples": [s.__dict__ for s in samples]})
    raw.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    assert tune.main(["--from-raw", str(raw), "--out", str(tmp_path / "t.json"),
                      "--bands", "2,8"]) == 0
    table = tuning_table.read(tmp_path / "t.json")
    assert table.rules == {"tree_final/float16/128": (
        (2, 64, (16, 2, 1)), (2, None, (64, 4, 2)), (None, None, (64, 4, 2)))}
    assert table.measured_on["timings"] == 6 and table.measured_on["bands"] == [2, 8]


def test_raw_timings_without_program_counts_are_refused(tmp_path):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"measured_on": {"arch": "sm90"}, "samples": []}))
    with pytest.raises(SystemExit, match="without program counts"):
        tune.main(["--from-raw", str(raw)])


@pytest.mark.parametrize("text", ["2,a", "8,2", "0,4", "2,2", "-1"])
def test_bad_bands_are_an_argparse_error(text):
    with pytest.raises(SystemExit):
        tune.main(["--from-raw", "unused.json", "--bands", text])


def test_a_config_missing_from_one_workload_of_a_bucket_cannot_win():
    samples = [sample("a", 64, (32, 2, 2), 10.0), sample("a", 64, (64, 4, 2), 11.0),
               sample("b", 64, (64, 4, 2), 20.0)]
    assert choose(samples)["tree_final/float16/128"] == ((None, None, (64, 4, 2)),)


def fake_manifest():
    def entry(kernel, n, w, s, **key):
        return {"kernel": kernel, "num_warps": w, "num_stages": s,
                "key": {"dtype": "float16", "HEAD_DIM": 128, "BLOCK_N": n, **key}}
    return {"kernels": [
        entry("paged_decode", 64, 4, 2, BLOCK_M=16, SPLIT=0),
        entry("paged_decode", 32, 2, 2, BLOCK_M=16, SPLIT=0),
        entry("paged_decode", 64, 4, 3, BLOCK_M=16, SPLIT=1),
        entry("tree_partial", 64, 4, 3, BLOCK_M=64, SLOT_RUNS=0),
        entry("tree_partial", 32, 2, 2, BLOCK_M=16, SLOT_RUNS=0),
        entry("tree_partial", 128, 8, 2, BLOCK_M=64, SLOT_RUNS=2),
        entry("tree_final", 32, 2, 2, BLOCK_M=16, PACKED=0, COMMON=0, DRAFT=0),
        entry("tree_final", 16, 2, 1, BLOCK_M=16, PACKED=0, COMMON=0, DRAFT=1),
        entry("tree_final", 64, 2, 2, BLOCK_M=16, PACKED=1, COMMON=0, DRAFT=0),
        entry("tree_final", 32, 2, 3, BLOCK_M=32, PACKED=1, COMMON=0, DRAFT=0),
        entry("tree_final", 64, 4, 2, BLOCK_M=16, PACKED=1, COMMON=1, DRAFT=0)]}


def test_compiled_configs_match_the_rule_lists_kernel_exactly():
    manifest = fake_manifest()
    assert tune.compiled_configs(manifest, "paged_decode/float16/128") == [(32, 2, 2), (64, 4, 2)]
    assert tune.compiled_configs(manifest, "paged_decode_split/float16/128") == [(64, 4, 3)]
    assert tune.compiled_configs(manifest, "tree_final/float16/128") == [(32, 2, 2)]
    assert tune.compiled_configs(manifest, "tree_final_draft/float16/128") == [(16, 2, 1)]
    assert tune.compiled_configs(manifest, "tree_final_packed/float16/128") == [(64, 2, 2)]
    assert tune.compiled_configs(manifest, "tree_final_packed_wide/float16/128") == [(32, 2, 3)]
    assert tune.compiled_configs(manifest, "tree_final_common/float16/128") == [(64, 4, 2)]
    assert tune.compiled_configs(manifest, "tree_final_common_wide/float16/128") == []
    assert tune.compiled_configs(manifest, "tree_partial/float16/128/64") == [(64, 4, 3)]
    assert tune.compiled_configs(manifest, "tree_partial/float16/128/16") == [(32, 2, 2)]
    assert tune.compiled_configs(manifest, "tree_final/bfloat16/128") == []
    assert tune.compiled_configs(manifest, "tree_partial/float16/128/64/two_runs") == \
        [(128, 8, 2)]
    assert tune.compiled_configs(manifest, "tree_partial/float16/128/64/one_run") == []


def test_a_refit_replaces_the_measured_lists_and_keeps_the_rest():
    base = tuning_table.Table("sm90", {"a/float16/128": ((None, None, (64, 4, 2)),),
                                       "b/float16/128": ((None, None, (32, 2, 2)),)},
                              {"device": "H100", "date": "2026-11-22"}, "base")
    rules, measured_on = tune.refit(base, {"b/float16/128": ((None, None, (64, 4, 3)),),
                                           "c/float16/128": ((None, None, (16, 2, 1)),)},
                                    {"device": "H200", "date": "2026-11-26"})
    assert rules == {"a/float16/128": ((None, None, (64, 4, 2)),),
                     "b/float16/128": ((None, None, (64, 4, 3)),),
                     "c/float16/128": ((None, None, (16, 2, 1)),)}
    assert measured_on == {"device": "H100", "date": "2026-11-22", "refits": [
        {"device": "H200", "date": "2026-11-26", "keys": ["b/float16/128", "c/float16/128"]}]}


def test_fixed_rules_pin_the_config_where_compiled_and_keep_the_rest():
    dispatch.reset()
    rules = tune.fixed_rules("sm90", (32, 2, 2), fake_manifest())
    assert rules["paged_decode/float16/128"] == ((None, None, (32, 2, 2)),)
    assert rules["tree_final/float16/128"] == ((None, None, (32, 2, 2)),)
    assert rules["tree_partial/float16/128/64"] == dispatch.rules(
        "tree_partial", "float16", 128, "sm90", 64)[0]


def test_written_tables_read_back(tmp_path):
    rules = {"tree_final/float16/128": ((0.5, 22, (16, 2, 1)), (0.5, None, (64, 4, 2)),
                                        (None, None, (32, 2, 2)))}
    tuning_table.write(tmp_path / "t.json", "sm90", rules, {"device": "x"})
    table = tuning_table.read(tmp_path / "t.json")
    assert table.rules == rules and table.arch == "sm90"
    assert json.loads((tmp_path / "t.json").read_text())["measured_on"] == {"device": "x"}


@pytest.mark.parametrize("text", ["64/4", "a/b/c", "64-4-2"])
def test_a_bad_fixed_config_is_an_argparse_error(text):
    with pytest.raises(SystemExit):
        tune.main(["--fixed", text])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_the_tuner_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        tune.main(["--fixed", "64/4/2"])


@gpu
def test_a_short_tuning_run_writes_a_table_dispatch_accepts(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "PREFIXES", (256,))
    monkeypatch.setattr(tune, "BRANCHES", (4, 32))
    monkeypatch.setattr(tune, "LEAVES", (8, 128))
    monkeypatch.setattr(tune, "GROUPS", (4,))
    monkeypatch.setattr(tune, "PAGED_SEQS", (4,))
    monkeypatch.setattr(tune, "PAGED_LENGTHS", (1024,))
    out = tmp_path / "table.json"
    assert tune.main(["--out", str(out), "--runs", "3", "--dtypes", "float16",
                      "--head-dims", "128", "--raw", str(tmp_path / "raw.json")]) == 0
    table = tuning_table.read(out)
    compiled = {k["name"] for k in tune.runtime.load_manifest(table.arch)["kernels"]}
    monkeypatch.setenv(tuning_table.ENV_VAR, str(out))
    dispatch.reset()
    try:  # dispatch reads the table, and every config it can pick names a compiled kernel
        for key, rule_list in table.rules.items():
            kernel, dtype, head_dim, block_m, runs = dispatch.parse_rule_key(key)
            where = (kernel, dtype, head_dim, table.arch, block_m, runs)
            assert dispatch.rules(*where)[0] == rule_list
            assert dispatch.rules(*where)[1].startswith(tuning_table.ENV_VAR)
            for _, _, config in rule_list:
                assert dispatch.kernel_spec(*where[:4], config, block_m, 0, runs).name in \
                    compiled, key
    finally:
        monkeypatch.delenv(tuning_table.ENV_VAR)
        dispatch.reset()
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["samples"] and all(s["programs"] > 0 for s in raw["samples"])
