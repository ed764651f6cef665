#!/usr/bin/env bash
# The README's test command. On a fresh machine with python3, pip and g++ (no GPU needed):
#  1. a venv with torch==2.13.0 and the package (editable, test and lint extras): ruff and
#     clang-format over the tree, then pytest;
#  2. the wheel, installed in a second fresh venv with no triton: it must import, hold cubins
#     for sm80/sm89/sm90 and run a decode through the PyTorch path;
#  3. its C library: exports only fr* symbols, needs only libc/libstdc++ (libcuda is opened at
#     run time), and examples/cpp compiles, links and loads against it (no GPU, no CUDA toolkit).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${FLASH_REASONING_CI_DIR:-}" ]; then
  work=$FLASH_REASONING_CI_DIR  # kept, to look at
else
  work=$(mktemp -d)  # two venvs with torch: ~2.7 GB a run, removed however the run ends
  trap 'rm -rf "$work"' EXIT
fi
echo "ci: working in $work"

python3 -m venv "$work/dev"
dev="$work/dev/bin/python"
"$dev" -m pip install -q --upgrade pip
"$dev" -m pip install -q torch==2.13.0
# Build requirements are installed first so both builds below reuse one AOT cache.
"$dev" -m pip install -q setuptools wheel "pybind11>=2.12" triton==3.6.0
"$dev" -m pip install -q --no-build-isolation -e ".[test,lint]"
"$dev" -m ruff check python tests benchmarks aot ci examples
find csrc examples/cpp \( -name '*.cc' -o -name '*.h' \) -print0 | sort -z |
  xargs -0 "$work/dev/bin/clang-format" --dry-run -Werror
echo "ci: lint ok (ruff, clang-format)"
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
from flash_reasoning.tools.synthetic import paged_problem
assert flash_reasoning.available_archs() == ["sm80", "sm89", "sm90"], flash_reasoning.available_archs()
wheel = zipfile.ZipFile(glob.glob("dist/flash_reasoning-*.whl")[0])
for arch in ("sm80", "sm89", "sm90"):
    cubins = [n for n in wheel.namelist() if f"_artifacts/{arch}/" in n and n.endswith(".cubin")]
    assert cubins, f"no {arch} cubins in the wheel"
p = paged_problem([33, 5], 8, 2, head_dim=128)
assert torch.isfinite(flash_reasoning.paged_decode(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)).all()
from flash_reasoning import tuning_table
assert tuning_table.load("sm90") is not None, "the shipped sm90 tuning table is not in the wheel"
assert "triton" not in sys.modules
print(f"wheel ok: {wheel.filename}, {sum(1 for n in wheel.namelist() if n.endswith('.cubin'))} cubins")
PY
)

capi_paths=$(cd "$work" && "$user" -m flash_reasoning.capi)
lib=$(sed -n 's/^library: *//p' <<<"$capi_paths")
lib_dir=$(dirname "$lib")
strays=$(nm -D --defined-only "$lib" | awk '{print $NF}' | grep -v '^fr' || true)
[ -z "$strays" ] || { echo "ci: $lib exports symbols beyond fr*: $strays"; exit 1; }
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
# libdl and libpthread are allowed: glibc before 2.34 keeps them apart from libc.
unexpected=$(grep -vE '^(libc\.so\.6|libstdc\+\+\.so\.6|ld-linux[-a-z0-9_.]*\.so\.[0-9]|libdl\.so\.2|libpthread\.so\.0)$' \
             <<<"$needed" || true)
[ -z "$unexpected" ] || { echo "ci: $lib needs more than libc/libstdc++: $unexpected"; exit 1; }
if command -v cmake > /dev/null; then
  cmake -S examples/cpp -B "$work/example" -DFLASH_REASONING_ROOT="$(dirname "$lib_dir")" > /dev/null
  cmake --build "$work/example" > /dev/null
else  # what the CMakeLists does
  mkdir -p "$work/example"
  g++ -std=c++17 -O2 -Wall -I"$(sed -n 's/^include: *//p' <<<"$capi_paths")" examples/cpp/tree_decode.cc \
      -L"$lib_dir" -lflash_reasoning -Wl,-rpath,"$lib_dir" -o "$work/example/tree_decode"
fi
# Without arguments it prints its usage and exits 2; LD_BIND_NOW resolves every symbol it uses first.
status=0
LD_BIND_NOW=1 "$work/example/tree_decode" > /dev/null 2>&1 || status=$?
[ "$status" -eq 2 ] || { echo "ci: the example did not load libflash_reasoning (status $status)"; exit 1; }
echo "capi ok: $lib exports $(nm -D --defined-only "$lib" | wc -l) fr* symbols, needs $(echo $needed)," \
     "the example builds and loads"
