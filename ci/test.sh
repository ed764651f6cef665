#!/usr/bin/env bash
# The README's test command. On a fresh machine with python3, pip and g++ (no GPU needed):
#  1. a venv with torch==2.13.0 and the package (editable, test extras), then pytest;
#  2. the wheel, installed in a second fresh venv with no triton: it must import, hold cubins
#     for sm80/sm89/sm90 and run a decode through the PyTorch path.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${FLASH_REASONING_CI_DIR:-$(mktemp -d)}
echo "ci: working in $work"

python3 -m venv "$work/dev"
dev="$work/dev/bin/python"
"$dev" -m pip install -q --upgrade pip
"$dev" -m pip install -q torch==2.13.0
# Build requirements are installed first so both builds below reuse one AOT cache.
"$dev" -m pip install -q setuptools wheel "pybind11>=2.12" triton==3.6.0
"$dev" -m pip install -q --no-build-isolation -e ".[test]"
"$dev" -m pytest -q -p no:cacheprovider

"$dev" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" .
python3 -m venv "$work/user"
user="$work/user/bin/python"
"$user" -m pip install -q torch==2.13.0 numpy
"$user" -m pip install -q --no-deps "$work"/dist/flash_reasoning-*.whl
(cd "$work" && "$user" - <<'PY'
import importlib.util, zipfile, glob, sys
assert importlib.util.find_spec("triton") is None, "triton must not be in the user venv"
import flash_reasoning, torch
from flash_reasoning.synthetic import paged_problem
assert flash_reasoning.available_archs() == ["sm80", "sm89", "sm90"], flash_reasoning.available_archs()
wheel = zipfile.ZipFile(glob.glob("dist/flash_reasoning-*.whl")[0])
for arch in ("sm80", "sm89", "sm90"):
    cubins = [n for n in wheel.namelist() if f"_artifacts/{arch}/" in n and n.endswith(".cubin")]
    assert cubins, f"no {arch} cubins in the wheel"
p = paged_problem([33, 5], 8, 2, head_dim=128)
assert torch.isfinite(flash_reasoning.paged_decode(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)).all()
assert "triton" not in sys.modules
print(f"wheel ok: {wheel.filename}, {sum(1 for n in wheel.namelist() if n.endswith('.cubin'))} cubins")
PY
)
