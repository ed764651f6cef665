"""ci/sanitize.py, the driver compute-sanitizer runs: its trees, plans and checks on CPU (the
plans run on the PyTorch path; tests/test_tree_attention.py interprets the kernels), the whole
script on a GPU (without the sanitizer, which ci/gpu_check.sh adds)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import gpu

SCRIPT = Path(__file__).resolve().parent.parent / "ci" / "sanitize.py"


@pytest.fixture
def sanitize(monkeypatch):
    """ci/sanitize.py as a module whose trees live on the CPU."""
    spec = importlib.util.spec_from_file_location("sanitize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    return module


def test_checker_counts_a_wrong_or_nan_result_as_a_failure(sanitize):
    check = sanitize.Checker()
    ref = torch.ones(2, 4, 8)
    check("right", ref.clone(), ref)
    check("wrong", ref * 2, ref)
    check("nan", torch.full_like(ref, float("nan")), ref)
    assert check.checks == 3 and check.failures == ["wrong", "nan"]


def test_plans_of_the_edge_trees_check_right(sanitize):
    check = sanitize.Checker()
    sanitize.check_tree(check, "deep, flat", *sanitize.deep_tree(), 4, lanes=(None, 4),
                        flat=True)
    sanitize.check_tree(check, "edges", *sanitize.edge_tree(torch.bfloat16, 2, 64), 1,
                        chunks=(16,), merges=(False, True))
    assert check.checks == 6 and not check.failures
    assert check.shared_plans and check.tiles  # plans with shared ranges and partials were made


def test_several_query_plans_check_right(sanitize):
    alloc, ids = sanitize.shared_prefix_tree(4, broken=True, head_dim=64)
    q_lens = [3, 0, 40, 5]
    check = sanitize.Checker()
    sanitize.check_tree(check, "several queries", alloc, ids, 2, q_lens=q_lens,
                        mask=sanitize.draft_masks(q_lens), chunks=(64,), tiles=(False, True),
                        folds=(True,))
    assert check.checks == 2 and not check.failures and check.query_tile_plans == 1


@gpu
def test_sanitize_script_runs_every_kernel_right():
    done = subprocess.run([sys.executable, str(SCRIPT), "--branches", "64"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert ", 0 wrong;" in done.stdout
