"""The AOT artifacts: the installed manifests and cubins, and the build itself."""
import hashlib
import itertools
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aot import build
from flash_reasoning import dispatch, runtime
from flash_reasoning.specializations import SCRATCH_PARAMS

ARCHS = tuple(build.archs_from_env())  # all three unless FLASH_REASONING_ARCHS narrows the build
EM_CUDA = 190
REPO = Path(__file__).resolve().parent.parent


def _manifest(arch):
    path = runtime.artifact_root() / arch / "manifest.json"
    assert path.exists(), f"no manifest for {arch} at {path}: was the package built?"
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_lists_valid_cubins(arch):
    manifest = _manifest(arch)
    assert manifest["arch"] == arch and manifest["triton_version"] == "3.6.0"
    assert manifest["ptxas_version"] != "unknown"
    for kernel in manifest["kernels"]:
        cubin = (runtime.artifact_root() / arch / kernel["cubin"]).read_bytes()
        assert hashlib.sha256(cubin).hexdigest() == kernel["sha256"], kernel["name"]
        e_machine, = struct.unpack_from("<H", cubin, 18)
        e_flags, = struct.unpack_from("<I", cubin, 48)
        assert cubin[:4] == b"\x7fELF" and e_machine == EM_CUDA, kernel["name"]
        assert e_flags & 0xFF == int(arch[2:]), f"{kernel['name']} is not an {arch} cubin"
        assert [tuple(p.values()) for p in kernel["params"][-2:]] == list(SCRATCH_PARAMS)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_spec_dispatch_can_ask_for_is_compiled(arch):
    kernels = {k["name"]: k for k in _manifest(arch)["kernels"]}
    for spec in dispatch.required_specs(arch):
        assert spec.name in kernels, f"{spec.name} missing from {arch}"
        compiled = kernels[spec.name]
        params = compiled["params"][:-2]
        assert [(p["name"], p["type"]) for p in params] == spec.runtime_params()
        maps = [p for p in params if "tensor_map" in p]
        assert [p["name"] for p in maps] == list(spec.tensor_maps), spec.name
        for p in maps:  # what the launcher encodes: the element type and the tile of one load
            assert p["tensor_map"]["data_type"] == {"float16": 6, "bfloat16": 9}[spec.dtype]
            assert p["tensor_map"]["elem_size"] == 2
            rows, cols = spec.tensor_map_tile()
            box_rows, box_cols = p["tensor_map"]["box"]
            assert box_rows == rows and box_cols * 2 in (64, 128) and cols % box_cols == 0
        assert compiled["key"] == spec.key
        assert compiled["overlaps_previous"] == spec.overlaps_previous, spec.name


@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_dispatch_rules_pick_what_python_picks(arch):
    """A C caller picks kernels by the manifest's exported rules (the launcher's pick is the
    C ABI's lookup): for every launch (range length, program count, unknowns included) it must
    get Python's kernel, at each bound and just past it."""
    from flash_reasoning import _core
    launcher = _core.Launcher(str(runtime.artifact_root() / arch))
    num_sms = 132
    for dtype in ("float16", "bfloat16"):
        for hd, (kernel, block_m) in itertools.product(dispatch.HEAD_DIMS, dispatch.RULE_LISTS):
            for page_size, slot_runs in dispatch.addressings(kernel):
                key = dispatch.rule_key(kernel, dtype, hd, block_m, page_size, slot_runs)
                rule_list = dispatch.rules(kernel, dtype, hd, arch, block_m, slot_runs)[0]
                token_bounds = {b for _, b, _ in rule_list if b}
                program_bounds = {math.floor(p * num_sms) for p, _, _ in rule_list if p}
                for tokens in {None, 1, 16, 17, 4096} | {b + d for b in token_bounds
                                                         for d in (0, 1)}:
                    for programs in {None, 1, 8192} | {b + d for b in program_bounds
                                                       for d in (0, 1)}:
                        config = dispatch.config_for(kernel, dtype, hd, arch, tokens, block_m,
                                                     programs, num_sms, slot_runs)
                        picked = launcher.pick(key, -1 if tokens is None else tokens,
                                               -1 if programs is None else programs, num_sms)
                        assert picked == dispatch.kernel_spec(
                            kernel, dtype, hd, arch, config, block_m, page_size,
                            slot_runs).name, \
                            (key, tokens, programs)
    assert _manifest(arch)["dispatch"]["constants"]["block_m"] == dispatch.BLOCK_M
    # Splits until about two programs run per SM, each of at least MIN_TOKENS_PER_SPLIT tokens,
    # at most MAX_SPLITS; none once the programs fill the SMs.
    for seqs, programs, length, splits in [(1, 8, 2048, 8), (4, 16, 32768, 5), (1, 2, 100, 1),
                                           (64, 8, 4096, 1), (3, 1, 700, 2), (0, 8, 10, 1),
                                           (1, 1, 1 << 20, dispatch.MAX_SPLITS)]:
        assert launcher.paged_decode_splits(seqs, programs, length, 132) == splits


def _build(out, cache):
    """The build compiles real cubins, so it runs outside this interpreter-mode process."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "aot.build", "--out", str(out), "--archs",
                             "sm80", "--cache", str(cache), "--jobs", "2"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_build_is_incremental(tmp_path):
    first = _build(tmp_path / "a", tmp_path / "cache")
    count = len(dispatch.required_specs("sm80"))
    assert f"compiled {count}, reused 0" in first
    assert f"compiled 0, reused {count}" in _build(tmp_path / "b", tmp_path / "cache")
    assert (tmp_path / "a/sm80/manifest.json").read_text() == \
        (tmp_path / "b/sm80/manifest.json").read_text()


def test_build_refuses_an_overlapping_kernel_that_never_waits():
    """A kernel launched to overlap its predecessor must wait for it (griddepcontrol.wait):
    tree_final compiles; tree_partial, once the tree kernels' wait is swapped for the signal
    that lets the next launch start, is refused."""
    script = textwrap.dedent("""
        from aot import build
        from aot.kernels import tree_attention
        from flash_reasoning import dispatch
        build.compile_spec("sm90", dispatch.tree_final_spec("float16", 64, "sm90"))
        tree_attention.wait_for_previous_launch = tree_attention.let_next_launch_start
        try:
            build.compile_spec("sm90", dispatch.tree_partial_spec("float16", 64, 16, "sm90"))
        except RuntimeError as err:
            print(err)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "never waits for it" in result.stdout and "tree_partial_fp16" in result.stdout


def test_build_narrows_archs_from_environment(monkeypatch):
    monkeypatch.setenv("FLASH_REASONING_ARCHS", "sm90")
    assert build.archs_from_env() == ["sm90"]
    monkeypatch.setenv("FLASH_REASONING_ARCHS", "sm75")
    with pytest.raises(SystemExit, match="sm75"):
        build.archs_from_env()


def test_spec_names_are_unique_and_keys_complete():
    from aot import grid
    for arch in grid.ARCHS:
        specs = grid.specs_for(arch, wide=True)
        assert len({s.name for s in specs}) == len(specs)


def test_candidate_packed_final_tiles_hold_a_token_of_each_lane():
    """A tuning run's packed final candidates (narrow and wide tile) have a KV tile of at
    least one token per row, so one per lane at GQA group 1 (grid.serves_every_lane)."""
    from aot import grid
    packed = [spec for spec in grid.candidate_specs("sm90")
              if spec.family == "tree_final" and spec.key["PACKED"]]
    assert {spec.key["BLOCK_M"] for spec in packed} == {dispatch.BLOCK_M,
                                                        dispatch.FINAL_WIDE_BLOCK_M}
    assert all(spec.key["BLOCK_N"] >= spec.key["BLOCK_M"] for spec in packed)
    assert any(spec.key["BLOCK_N"] < dispatch.FINAL_WIDE_BLOCK_M for spec in packed)
