#!/usr/bin/env bash
# Run on a GPU machine: build for this GPU's arch only, check the driver structs against cuda.h,
# run the GPU tests (pytest -m gpu; CPU CI runs the rest), compute-sanitizer and the GPU fuzz
# test, then the bench (and its figure where matplotlib is installed), the extend bench
# (benchmarks/extend.py), the demo, the C++ example and the host-side benchmarks. Logs and JSON
# go to $OUT (or ./gpu-logs).
# SKIP="sanitize fuzz" skips the steps whose logs have those names (to split a run over calls);
# PYTEST_ARGS (default "tests -m gpu", split on spaces) and PYTEST_K (one -k expression) choose
# the tests.
# AOT_GRID=wide compiles every candidate config, then tunes a table and checks it
# (benchmarks/tuned_vs_fixed.py): docs/tuning.md.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cc=$(python3 -c 'import torch; print("sm%d%d" % torch.cuda.get_device_capability())')
case "$cc" in sm90) arch=sm90 ;; sm89) arch=sm89 ;; sm8*) arch=sm80 ;; *) echo "unsupported $cc"; exit 2 ;; esac
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# cffi (the C ABI's tests) travels as wheels in .whl/ when the machine lacks it.
if ! python3 -c "import cffi" 2>/dev/null && ls .whl/cffi-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export FLASH_REASONING_ARCHS=$arch  # the build and the manifest tests cover this arch only
step() {
  case " ${SKIP:-} " in *" ${log%.log} "*) echo "== $1: skipped"; return 0 ;; esac
  echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT/$log"; return "${PIPESTATUS[0]}"
}
status=0
log=build.log  step "build ($arch)" env FLASH_REASONING_AOT_GRID=${AOT_GRID:-} \
    python3 -m pip install --no-build-isolation --no-deps -e . || exit 1
log=layout.log step "driver struct layout against cuda.h" bash -c 'g++ -std=c++17 -fsyntax-only -Icsrc \
    -I"$(dirname "$(command -v nvcc)")/../include" ci/driver_layout_check.cc && echo "layout ok"' || status=1
log=tests.log  step "tests" python3 -m pytest ${PYTEST_ARGS:-tests -m gpu} ${PYTEST_K:+-k "$PYTEST_K"} -q \
    -p no:cacheprovider || status=1
log=sanitize.log step "compute-sanitizer" env OUT="$OUT" bash ci/sanitize.sh || status=1
log=fuzz.log   step "fuzz (${FUZZ_EXAMPLES:-2000} trees)" env FLASH_REASONING_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-2000} \
    python3 -m pytest tests/test_fuzz.py -k gpu_fuzz -q -p no:cacheprovider || status=1
log=info.log   step "info" python3 -m flash_reasoning.tools.cli info || status=1
log=bench.log  step "bench" python3 -m flash_reasoning.tools.cli bench --json "$OUT/bench.json" \
    ${BENCH_ARGS:-} || status=1
if python3 -c "import matplotlib" 2>/dev/null; then  # else: flash-reasoning plot bench.json
  log=bench.log step "plot" python3 -m flash_reasoning.tools.cli plot "$OUT/bench.json" \
      "$OUT/bench.png" || status=1
fi
log=extend.log step "several queries per branch" python3 benchmarks/extend.py \
    --json "$OUT/extend.json" || status=1
log=demo.log   step "demo" python3 -m flash_reasoning.tools.cli demo --check --steps 24 \
    --prefix 2048 --width 64 --layers 8 --num-qo-heads 32 --num-kv-heads 8 --head-dim 128 \
    || status=1
log=host.log   step "allocator host cost" python3 benchmarks/allocator_host_cost.py || status=1
log=example.log step "C++ example" bash -c 'python3 examples/cpp/make_reference.py build/reference.bin \
    --device cuda && cmake -S examples/cpp -B build/example -DPython3_EXECUTABLE="$(command -v python3)" \
    >/dev/null && cmake --build build/example >/dev/null && build/example/tree_decode \
    python/flash_reasoning/_artifacts build/reference.bin' || status=1
log=warmup.log step "zero warm-up" python3 benchmarks/warmup.py --json "$OUT/warmup.json" \
    ${WARMUP_ARGS:-} || status=1
log=launch.log step "launch overhead" python3 benchmarks/launch_overhead.py \
    --json "$OUT/launch_overhead.json" || status=1
if [ "${AOT_GRID:-}" = wide ]; then  # every candidate is compiled: tune, then check the table
  log=tune.log step "tune" python3 -m flash_reasoning.tools.tune --out "$OUT/tuning-$arch.json" \
      --raw "$OUT/tuning-raw-$arch.json" || status=1
  log=fixed.log step "tuned vs fixed configs" env FLASH_REASONING_TUNING="$OUT/tuning-$arch.json" \
      python3 benchmarks/tuned_vs_fixed.py --json "$OUT/tuned_vs_fixed.json" || status=1
fi
exit $status
