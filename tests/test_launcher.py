"""Tests of the C++ kernel launcher (flash_reasoning._core), runnable without a GPU.

libcuda is loaded at most once per process, so every test that touches the driver runs in a
fresh interpreter (`isolated`), with FLASH_REASONING_LIBCUDA pointing at a missing file, at a
library without the driver API, or at a fake driver compiled from FAKE_LIBCUDA below.
"""

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import gpu
from flash_reasoning import _core
from flash_reasoning._core import CoreError, Hole, Launcher

NAME = "paged_decode_fp16_d128_m16_n64_split0_w4_s2"
CUBIN = b"CUBIN: stands in for a real cubin"
PARAMS = [("q", "*fp16"), ("num_kv_heads", "i32"), ("sm_scale", "fp32")]
SCRATCH = [("global_scratch", "*i8"), ("profile_scratch", "*i8")]


def kernel_entry(name=NAME, data=CUBIN, sha=None, **overrides):
    entry = {
        "name": name, "kernel": "paged_decode", "entry": "paged_decode", "cubin": name + ".cubin",
        "sha256": sha or hashlib.sha256(data).hexdigest(), "key": {"dtype": "float16", "HEAD_DIM": 128},
        "params": [{"name": n, "type": t} for n, t in PARAMS + SCRATCH],
        "num_warps": 4, "num_stages": 2, "shared": 65536, "source_hash": "x",
    }
    entry.update(overrides)
    return entry


def write_arch(root, kernels=None, arch="sm90", cubins=None, **top):
    """An arch folder: manifest.json plus one cubin file per kernel (bytes from `cubins`)."""
    folder = root / arch
    folder.mkdir(parents=True, exist_ok=True)
    kernels = kernels if kernels is not None else [kernel_entry()]
    for k in kernels:
        if "cubin" in k:
            (folder / k["cubin"]).write_bytes((cubins or {}).get(k.get("name"), CUBIN))
    manifest = {"format": 1, "arch": arch, "triton_version": "3.6.0", "ptxas_version": "12.8",
                "package_version": "0.1.0", "kernels": kernels, **top}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def raises(fn, *fragments):
    with pytest.raises(CoreError) as info:
        fn()
    for f in fragments:
        assert f in str(info.value), f"{f!r} not in {str(info.value)!r}"
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.code, int) and info.value.code > 0
    # Bad caller input (FR_INVALID_ARGUMENT) is a ValueError as well; nothing else is.
    assert isinstance(info.value, ValueError) == (info.value.code == 1)
    return info.value


PRELUDE = """
import ctypes, json, os
from flash_reasoning import _core as L
def attempt(fn):
    try:
        return {"ok": fn()}
    except L.CoreError as e:
        return {"error": str(e), "code": e.code}
out = {}
"""


def isolated(body, libcuda, timeout=120, memory=None):
    """Runs `body` (which fills the dict `out`) in a fresh interpreter, within `timeout` seconds
    and, given `memory`, that many bytes of address space; returns `out`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FLASH_REASONING_LIBCUDA": str(libcuda)}
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    limit = memory and (lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory)))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit or None, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- select_arch

@pytest.mark.parametrize("cc, available, expected", [
    (80, ["sm80", "sm89", "sm90"], "sm80"),
    (86, ["sm80", "sm89", "sm90"], "sm80"),
    (89, ["sm80", "sm89", "sm90"], "sm89"),
    (89, ["sm90", "sm80"], "sm80"),
    (87, ["sm89", "sm86", "sm80"], "sm86"),
    (90, ["sm80", "sm89", "sm90"], "sm90"),
])
def test_select_arch(cc, available, expected):
    assert _core.select_arch(cc, available) == expected


@pytest.mark.parametrize("cc, available, device", [
    (75, ["sm80", "sm89", "sm90"], "sm75"),
    (100, ["sm80", "sm89", "sm90"], "sm100"),
    (120, ["sm90"], "sm120"),
    (86, [], "sm86"),
    (86, ["sm89", "sm90"], "sm86"),
    (90, ["sm80", "sm89"], "sm90"),
])
def test_select_arch_no_match(cc, available, device):
    err = raises(lambda: _core.select_arch(cc, available), device, *available)
    assert err.code == 7


# ---------------------------------------------------------------- manifest

def test_manifest_contents(tmp_path):
    folder = write_arch(tmp_path, [kernel_entry(), kernel_entry("other")])
    for arch_dir in (folder, str(folder)):
        launcher = Launcher(arch_dir, 0)
        assert launcher.arch == "sm90"
        assert launcher.kernel_names() == [NAME, "other"]
        assert launcher.params(NAME) == PARAMS


def test_missing_folder(tmp_path):
    raises(lambda: Launcher(tmp_path / "sm90", 0), str(tmp_path / "sm90" / "manifest.json"), "not found")


def test_invalid_json(tmp_path):
    folder = write_arch(tmp_path)
    (folder / "manifest.json").write_text('{"format": 1, "kernels": [}')
    raises(lambda: Launcher(folder, 0), "invalid JSON", "manifest.json")


# What a file that is not a regular file is called in errors, and how a test makes one.
NOT_REGULAR = {"fifo": "a FIFO", "dev_zero": "a character device", "directory": "a directory"}


def make_not_regular(path, kind):
    """Replaces `path` with a FIFO (an open would block until a writer comes), a link to
    /dev/zero (endless bytes) or a directory."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


# A bound on the fresh interpreters that read such files: a hang or an endless read fails the
# test in seconds, without taking the machine's memory.
BOUNDS = {"timeout": 30, "memory": 2 << 30}


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_manifest_that_is_not_a_regular_file(tmp_path, kind):
    folder = write_arch(tmp_path)
    make_not_regular(folder / "manifest.json", kind)
    out = isolated(f"out['load'] = attempt(lambda: L.Launcher({str(folder)!r}, 0))", "/nonexistent/libcuda", **BOUNDS)
    assert out["load"]["code"] == 8  # kIoError
    assert f"manifest {folder / 'manifest.json'} is {NOT_REGULAR[kind]}, not a regular file" in out["load"]["error"]


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_cubin_that_is_not_a_regular_file(tmp_path, fake_libcuda, kind):
    folder = write_arch(tmp_path)
    make_not_regular(folder / (NAME + ".cubin"), kind)
    out = isolated(f"""
        launcher = L.Launcher({str(folder)!r}, 0)
        out["launch"] = attempt(lambda: launcher.launch({NAME!r}, (1, 1, 1), [0, 1, 1.0], 0))
    """, fake_libcuda, **BOUNDS)
    assert out["launch"]["code"] == 8
    assert f"cubin {folder / (NAME + '.cubin')} is {NOT_REGULAR[kind]}, not a regular file" in out["launch"]["error"]


def test_manifest_larger_than_any_manifest(tmp_path):
    """A manifest is read whole: past 64 MiB (a hundred times a three-arch build's) it is not
    one. The file is sparse: the test writes and reads nothing."""
    folder = write_arch(tmp_path)
    with open(folder / "manifest.json", "r+b") as f:
        f.truncate((64 << 20) + 1)
    err = raises(lambda: Launcher(folder, 0), f"manifest {folder / 'manifest.json'} is 67108865 bytes",
                 "more than the 67108864")
    assert err.code == 8


@pytest.mark.parametrize("field", ["name", "entry", "cubin", "sha256", "params", "num_warps", "shared"])
def test_kernel_missing_field(tmp_path, field):
    entry = kernel_entry()
    del entry[field]
    folder = write_arch(tmp_path, [entry])
    raises(lambda: Launcher(folder, 0), f"kernels[0].{field}", "missing")


@pytest.mark.parametrize("field", ["format", "arch", "kernels"])
def test_top_level_missing_field(tmp_path, field):
    folder = write_arch(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest[field]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    raises(lambda: Launcher(folder, 0), f"'{field}'", "missing")


def dispatch_section(rules):
    return {"rules": {"tree_final/float16/128": rules}, "constants": {"block_m": 16}}


def test_dispatch_rules_pick_by_programs_per_sm_then_tokens(tmp_path):
    folder = write_arch(tmp_path, [kernel_entry(), kernel_entry("other")], dispatch=dispatch_section(
        [[2, 64, NAME], [2, None, "other"], [None, None, NAME]]))
    launcher = Launcher(folder, 0)

    def pick(tokens, programs, num_sms=132):
        return launcher.pick("tree_final/float16/128", tokens, programs, num_sms)
    assert pick(64, 264) == NAME and pick(65, 264) == "other" and pick(65, 265) == NAME
    assert pick(-1, 10) == "other"  # unknown length: long
    assert pick(10, -1) == NAME and pick(10, 10, -1) == NAME  # unknown count: many
    raises(lambda: launcher.pick("tree_final/float16/64", 1), "no compiled kernel serves")


@pytest.mark.parametrize("rules, fragment", [
    ([[None, NAME]], "must be [max_programs_per_sm or null, max_tokens or null, kernel name]"),
    ([[0, None, NAME], [None, None, NAME]], "bounds positive"),
    ([["2", None, NAME], [None, None, NAME]], "bounds positive"),
    ([[None, -4, NAME], [None, None, NAME]], "bounds positive"),
    ([[2, None, NAME]], "must end with a rule for any launch"),
    ([[None, None, "missing"]], "names kernel 'missing'"),
])
def test_bad_dispatch_rules_are_refused(tmp_path, rules, fragment):
    folder = write_arch(tmp_path, dispatch=dispatch_section(rules))
    raises(lambda: Launcher(folder, 0), "dispatch.rules.tree_final/float16/128", fragment)


@pytest.mark.parametrize("overrides, fragments", [
    ({"params": [{"name": "n", "type": "i33"}] + [{"name": n, "type": t} for n, t in SCRATCH]},
     ["kernels[0].params[0].type", "i33"]),
    ({"params": [{"name": "q", "type": "*fp16"}, {"name": "x", "type": "i32"}]}, ["scratch"]),
    ({"num_warps": 0}, ["kernels[0].num_warps"]),
    ({"shared": 1.5}, ["kernels[0].shared"]),
    ({"sha256": "abc"}, ["kernels[0].sha256"]),
    ({"cubin": "../escape.cubin"}, ["kernels[0].cubin"]),
    ({"overlaps_previous": 1}, ["kernels[0].overlaps_previous", "true or false"]),
])
def test_kernel_bad_field(tmp_path, overrides, fragments):
    entry = kernel_entry(**overrides)
    folder = tmp_path / "sm90"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "kernels": [entry]}))
    raises(lambda: Launcher(folder, 0), *fragments)


def test_duplicate_kernel_name(tmp_path):
    raises(lambda: Launcher(write_arch(tmp_path, [kernel_entry(), kernel_entry()]), 0), "kernels[1].name", NAME)


# ---------------------------------------------------------------- launch argument checks (no driver reached)

@pytest.fixture
def launcher(tmp_path):
    return Launcher(write_arch(tmp_path), 0)


def test_unknown_kernel(launcher):
    err = raises(lambda: launcher.launch("nope", (1, 1, 1), [0, 1, 1.0], 0), "unknown kernel 'nope'", "sm90", NAME)
    assert err.code == 2
    raises(lambda: launcher.params("nope"), "unknown kernel 'nope'")


def test_wrong_arg_count(launcher):
    raises(lambda: launcher.launch(NAME, (1, 1, 1), [0, 1], 0), "takes 3 arguments, got 2")


@pytest.mark.parametrize("args, fragments", [
    ([0, 2**40, 1.0], ["'num_kv_heads'", "i32", str(2**40)]),
    ([0, -2**31 - 1, 1.0], ["'num_kv_heads'"]),
    ([0, 2**70, 1.0], ["'num_kv_heads'", "beyond 64 bits"]),
    ([0, 1.5, 1.0], ["'num_kv_heads'"]),
    ([-8, 1, 1.0], ["'q'", "*fp16"]),
    ([0.0, 1, 1.0], ["'q'"]),
    (["0", 1, 1.0], ["'q'", "not a number"]),
    ([0, 1, 1e300], ["'sm_scale'", "fp32"]),
])
def test_bad_argument(launcher, args, fragments):
    raises(lambda: launcher.launch(NAME, (1, 1, 1), args, 0), *fragments)


@pytest.mark.parametrize("grid", [(-1, 1, 1), (1, -2, 1), (1, 1, 70000)])
def test_bad_grid(launcher, grid):
    raises(lambda: launcher.launch(NAME, grid, [0, 1, 1.0], 0), "grid dimension")


# ---------------------------------------------------------------- prepared launches (no driver reached)

EMPTY = (0, 4, 1)  # a grid with a zero dimension: the launcher returns Ok without the driver


def prepared(launcher, grids=(EMPTY, EMPTY)):
    """Two launches of NAME: the first reads hole 0 ('q') as its 'q', the second hole 1 ('out')."""
    return launcher.prepare([(NAME, grids[0], [Hole(0), 3, 0.5]), (NAME, grids[1], [Hole(1), -2, 1.0])],
                            ["q", "out"])


def test_prepared_run_of_empty_launches(launcher):
    seq = prepared(launcher)
    assert seq.holes == ["q", "out"] and seq.num_launches == 0  # empty grids are dropped
    assert seq.run([0x1000, 0x2000], 0) is None and seq.run((16, 2**64 - 16), 7) is None
    assert prepared(launcher, grids=(EMPTY, (2, 3, 1))).num_launches == 1


@pytest.mark.parametrize("pointers, fragments", [
    ([16], ["take 2 pointers (q, out), got 1"]),
    ([16, 32, 48], ["take 2 pointers (q, out), got 3"]),
    ([0, 32], ["pointer 0 ('q', passed as argument 'q' of kernel '" + NAME + "') is null"]),
    ([16, 0], ["pointer 1 ('out'", "is null"]),
    ([16, 0x2008], ["pointer 1 ('out', passed as argument 'q'", "0x2008, not 16-byte aligned"]),
    ([-16, 32], ["pointer 0 ('q') must be an int in [0, 2**64), got -16"]),
    ([16, 2**64], ["pointer 1 ('out') must be an int", str(2**64)]),
    ([16, 32.0], ["pointer 1 ('out') must be an int", "32.0"]),
    ([16, None], ["pointer 1 ('out') must be an int", "None"]),
    (16, ["pointers must be a sequence of ints, got int"]),
])
def test_prepared_run_rejects_bad_pointers(launcher, pointers, fragments):
    err = raises(lambda: prepared(launcher).run(pointers, 0), *fragments)
    assert err.code == 1


@pytest.mark.parametrize("launches, fragments", [
    ([(NAME, EMPTY, [Hole(2), 1, 1.0])], ["prepared launch 0 of 1", "argument 0 ('q', *fp16) takes pointer 2",
                                          "has 2 pointers"]),
    ([(NAME, EMPTY, [0, Hole(0), 1.0])], ["argument 1 ('num_kv_heads', i32) cannot be a per-run pointer"]),
    ([(NAME, EMPTY, [0, 1, Hole(1)])], ["argument 2 ('sm_scale', fp32) cannot be a per-run pointer"]),
    ([(NAME, EMPTY, [0x1238, 1, 1.0])], ["argument 0 ('q', *fp16) is 0x1238, not 16-byte aligned"]),
    ([(NAME, EMPTY, [Hole(0), 1, 1.0]), (NAME, EMPTY, [Hole(1), 1])],
     ["prepared launch 1 of 2", "takes 3 arguments, got 2"]),
    ([(NAME, EMPTY, [Hole(0), 2**40, 1.0])], ["'num_kv_heads'", str(2**40)]),
    ([(NAME, EMPTY, [Hole(0), 1, "x"])], ["'sm_scale'", "not a number"]),
    ([(NAME, (1, 1, 70000), [Hole(0), 1, 1.0])], ["grid dimension 2 is 70000"]),
    ([(NAME, EMPTY, [Hole(0), 1, 1.0]), ("nope", EMPTY, [])], ["prepared launch 1 of 2", "unknown kernel 'nope'"]),
    ([(NAME, (1, 1), [Hole(0), 1, 1.0])], ["prepared launch 0 of 1: must be (kernel name, (x, y, z) grid, args)"]),
    (["nope"], ["must be (kernel name"]),
])
def test_prepare_rejects_bad_launches(launcher, launches, fragments):
    raises(lambda: launcher.prepare(launches, ["q", "out"]), *fragments)


def test_prepare_rejects_bad_holes(launcher):
    raises(lambda: Hole(-1), "hole index must be >= 0, got -1")
    many = [f"p{i}" for i in range(65)]
    raises(lambda: launcher.prepare([(NAME, EMPTY, [Hole(64), 1, 1.0])], many), "at most 64 pointers, got 65")
    assert repr(Hole(3)) == "Hole(3)" and Hole(3).index == 3


# ---------------------------------------------------------------- driver loading (fresh interpreter each)

def test_missing_libcuda(tmp_path):
    folder = write_arch(tmp_path)
    out = isolated(f"""
        launcher = L.Launcher({str(folder)!r}, 0)
        out["empty"] = attempt(lambda: launcher.launch({NAME!r}, (0, 4, 1), [0, 1, 1.0], 0))
        out["launch"] = attempt(lambda: launcher.launch({NAME!r}, (4, 1, 1), [0, 1, 1.0], 0))
        out["again"] = attempt(lambda: launcher.launch({NAME!r}, (4, 1, 1), [0, 1, 1.0], 0))
        out["cc"] = attempt(lambda: L.device_compute_capability(0))
    """, libcuda=tmp_path / "no" / "libcuda.so.1")
    assert out["empty"] == {"ok": None}  # a grid with a zero dimension is empty work
    for key in ("launch", "again", "cc"):
        assert "could not load libcuda" in out[key]["error"], out[key]
        assert "NVIDIA driver" in out[key]["error"] and out[key]["code"] == 5


def test_prepared_run_checks_pointers_before_the_driver(tmp_path):
    folder = write_arch(tmp_path)
    out = isolated(f"""
        launcher = L.Launcher({str(folder)!r}, 0)
        seq = launcher.prepare([({NAME!r}, (4, 1, 1), [L.Hole(0), 1, 1.0])], ["q"])
        out["misaligned"] = attempt(lambda: seq.run([0x1234], 0))
        out["launch"] = attempt(lambda: seq.run([0x1230], 0))
    """, libcuda=tmp_path / "no" / "libcuda.so.1")
    assert "pointer 0 ('q'" in out["misaligned"]["error"] and "not 16-byte aligned" in out["misaligned"]["error"]
    assert "could not load libcuda" in out["launch"]["error"] and out["launch"]["code"] == 5


def test_library_without_driver_api(tmp_path):
    out = isolated('out["cc"] = attempt(lambda: L.device_compute_capability(0))', libcuda="libm.so.6")
    assert "no symbol cuInit" in out["cc"]["error"]


# A stand-in for libcuda: records what the launcher passes to the driver.
FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
static int ctx_obj, mod_obj, fn_obj;
static void* current;
int fake_loads, fake_launches, fake_smem = -1;
unsigned fake_dims[7];
unsigned char fake_params[32];
static const char* names(int rc) {
  return rc == 101 ? "CUDA_ERROR_INVALID_DEVICE" : rc == 209 ? "CUDA_ERROR_NO_BINARY_FOR_GPU"
       : rc == 500 ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_UNKNOWN";
}
int cuInit(unsigned f) { return 0; }
int cuGetErrorName(int rc, const char** s) { *s = names(rc); return 0; }
int cuGetErrorString(int rc, const char** s) { *s = "fake driver"; return 0; }
int cuDeviceGet(int* d, int ordinal) { *d = ordinal; return ordinal == 0 ? 0 : 101; }
/* cc 9.0 (major is attribute 75, minor 76) and an H100's 132 SMs (attribute 16). */
int cuDeviceGetAttribute(int* v, int attr, int d) { *v = attr == 75 ? 9 : attr == 16 ? 132 : 0; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = &ctx_obj; return 0; }
int cuCtxGetCurrent(void** c) { *c = current; return 0; }
int cuCtxSetCurrent(void* c) { current = c; return 0; }
int cuModuleLoadData(void** m, const void* image) {
  if (memcmp(image, "CUBIN", 5) != 0) return 209;
  fake_loads++; *m = &mod_obj; return 0;
}
int cuModuleUnload(void* m) { return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) {
  if (strcmp(name, "paged_decode") != 0) return 500;
  *f = &fn_obj; return 0;
}
int cuFuncSetAttribute(void* f, int attr, int v) { if (attr == 8) fake_smem = v; return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void* stream, void** params, void** extra) {
  unsigned dims[7] = {gx, gy, gz, bx, by, bz, shared};
  memcpy(fake_dims, dims, sizeof dims);
  memcpy(fake_params, params[0], 8); memcpy(fake_params + 8, params[1], 4);
  memcpy(fake_params + 12, params[2], 4); memcpy(fake_params + 16, params[3], 8);
  memcpy(fake_params + 24, params[4], 8);
  fake_launches++; return 0;
}
/* Device memory is host memory here: the C ABI's copies and plans work unchanged. */
int cuMemAlloc_v2(unsigned long long* p, size_t n) { *p = (unsigned long long)malloc(n ? n : 1); return *p ? 0 : 2; }
int cuMemFree_v2(unsigned long long p) { free((void*)p); return 0; }
int cuMemcpyHtoD_v2(unsigned long long d, const void* s, size_t n) { memcpy((void*)d, s, n); return 0; }
int cuMemcpyDtoH_v2(void* d, unsigned long long s, size_t n) { memcpy(d, (void*)s, n); return 0; }
int cuMemcpyHtoDAsync_v2(unsigned long long d, const void* s, size_t n, void* st) { memcpy((void*)d, s, n); return 0; }
int cuStreamSynchronize(void* st) { return 0; }
#ifdef WITH_TENSOR_MAP
/* Records its arguments (data type, rank, address, dims, row stride, box, swizzle) and writes the
   address + 1 into the map's first 8 bytes, so a launch's params show which map they point at. */
unsigned long long fake_map_args[9];
int cuTensorMapEncodeTiled(unsigned long long* map, int type, unsigned rank, void* address,
                           const unsigned long long* dims, const unsigned long long* strides,
                           const unsigned* box, const unsigned* elem_strides, int interleave,
                           int swizzle, int l2, int fill) {
  unsigned long long args[9] = {type, rank, (unsigned long long)address, dims[0], dims[1], strides[0],
                                box[0], box[1], swizzle};
  memcpy(fake_map_args, args, sizeof args);
  if (elem_strides[0] != 1 || elem_strides[1] != 1 || interleave != 0 || fill != 0) return 1;
  map[0] = (unsigned long long)address + 1;
  return (unsigned long long)address == 0xbad0 ? 1 : 0;
}
#endif
#ifdef WITH_LAUNCH_EX
/* cuLaunchKernelEx as cuda.h lays out its config; records the first attribute. */
typedef struct { int id; char pad[4]; union { char bytes[64]; int allowed; void* align; } value; } Attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shared; void* stream; Attr* attrs; unsigned num_attrs; } Config;
int fake_ex_launches, fake_ex_attr[3];  /* count, then num_attrs, id and value of the last */
int cuLaunchKernelEx(const Config* c, void* f, void** params, void** extra) {
  unsigned dims[7] = {c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shared};
  memcpy(fake_dims, dims, sizeof dims);
  fake_ex_attr[0] = (int)c->num_attrs; fake_ex_attr[1] = c->attrs[0].id; fake_ex_attr[2] = c->attrs[0].value.allowed;
  fake_ex_launches++; return 0;
}
#endif
"""


def build_fake_libcuda(folder, *flags):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler to build the fake libcuda")
    (folder / "fake.c").write_text(FAKE_LIBCUDA)
    lib = folder / f"libcuda_fake{''.join(flags)}.so"
    subprocess.run([compiler, "-shared", "-fPIC", *flags, "-o", str(lib), str(folder / "fake.c")], check=True)
    return lib


@pytest.fixture
def fake_libcuda(tmp_path):
    return build_fake_libcuda(tmp_path)


@pytest.fixture
def fake_libcuda_ex(tmp_path):
    """The fake driver with cuLaunchKernelEx (CUDA 12+)."""
    return build_fake_libcuda(tmp_path, "-DWITH_LAUNCH_EX")


def test_fake_driver_launch(tmp_path, fake_libcuda):
    folder = write_arch(tmp_path)
    out = isolated(f"""
        fake = ctypes.CDLL({str(fake_libcuda)!r})
        launcher = L.Launcher({str(folder)!r}, 0)
        out["cc"] = attempt(lambda: L.device_compute_capability(0))
        out["bad_device"] = attempt(lambda: L.device_compute_capability(3))
        for _ in range(2):
            out["launch"] = attempt(lambda: launcher.launch({NAME!r}, (5, 6, 7), [0x1234, -7, 0.5], 99))
        out["dims"] = list((ctypes.c_uint * 7).in_dll(fake, "fake_dims"))
        out["params"] = bytes((ctypes.c_ubyte * 32).in_dll(fake, "fake_params")).hex()
        out["counts"] = [ctypes.c_int.in_dll(fake, n).value for n in ("fake_loads", "fake_launches", "fake_smem")]
    """, libcuda=fake_libcuda)
    assert out["cc"] == {"ok": 90}
    assert "cuDeviceGet(3)" in out["bad_device"]["error"] and "CUDA_ERROR_INVALID_DEVICE" in out["bad_device"]["error"]
    assert out["launch"] == {"ok": None}
    assert out["dims"] == [5, 6, 7, 128, 1, 1, 65536]
    expected = (0x1234).to_bytes(8, "little") + (-7).to_bytes(4, "little", signed=True)
    expected += bytes.fromhex("0000003f") + bytes(16)  # 0.5f, then the two null scratch pointers
    assert out["params"] == expected.hex()
    assert out["counts"] == [1, 2, 65536]  # loaded once, launched twice, large smem opted in


def test_fake_driver_prepared_run(tmp_path, fake_libcuda):
    """Each run fills the hole with its own pointer and launches every non-empty launch (the
    empty one between is skipped); a bad pointer launches nothing, not even the first launch."""
    folder = write_arch(tmp_path)
    out = isolated(f"""
        fake = ctypes.CDLL({str(fake_libcuda)!r})
        launcher = L.Launcher({str(folder)!r}, 0)
        seq = launcher.prepare([({NAME!r}, (5, 6, 7), [L.Hole(1), -7, 0.5]),
                                ({NAME!r}, (0, 1, 1), [L.Hole(0), 1, 1.0]),
                                ({NAME!r}, (2, 1, 1), [L.Hole(0), 3, 2.0])], ["a", "b"])
        launches = lambda: ctypes.c_int.in_dll(fake, "fake_launches").value
        params = lambda: bytes((ctypes.c_ubyte * 32).in_dll(fake, "fake_params")).hex()
        dims = lambda: list((ctypes.c_uint * 7).in_dll(fake, "fake_dims"))
        out["num_launches"] = seq.num_launches
        out["first"] = attempt(lambda: seq.run([0x1230, 0x4560], 99))
        out["first_params"], out["first_dims"], out["first_count"] = params(), dims(), launches()
        out["second"] = attempt(lambda: seq.run([0x7770, 0x8880], 99))
        out["second_params"], out["second_count"] = params(), launches()
        out["bad"] = attempt(lambda: seq.run([0x7770, 0x8881], 99))
        out["bad_count"] = launches()
        one = launcher.prepare([({NAME!r}, (5, 6, 7), [L.Hole(1), -7, 0.5])], ["a", "b"])
        out["one"] = attempt(lambda: one.run([0x10, 0x20], 99))
        out["one_params"], out["one_dims"] = params(), dims()
    """, libcuda=fake_libcuda)
    assert out["num_launches"] == 2
    assert out["first"] == out["second"] == {"ok": None}
    tail = bytes(16).hex()  # the two null scratch pointers
    # The last launch's params: hole 0 as 'q', then 3 (i32) and 2.0f.
    assert out["first_params"] == (0x1230).to_bytes(8, "little").hex() + "03000000" + "00000040" + tail
    assert out["second_params"] == (0x7770).to_bytes(8, "little").hex() + "03000000" + "00000040" + tail
    assert out["first_dims"] == [2, 1, 1, 128, 1, 1, 65536]
    assert (out["first_count"], out["second_count"]) == (2, 4)
    assert "pointer 1 ('b', passed as argument 'q'" in out["bad"]["error"] and out["bad_count"] == 4
    assert out["one"] == {"ok": None} and out["one_dims"] == [5, 6, 7, 128, 1, 1, 65536]
    assert out["one_params"] == (0x20).to_bytes(8, "little").hex() + "f9ffffff" + "0000003f" + tail


OVERLAPPING = "tree_final_waits"


def overlap_run(tmp_path, libcuda):
    """A kernel marked overlaps_previous, launched after another launch of a prepared sequence,
    first in one, and alone: what reached the driver each time."""
    folder = write_arch(tmp_path, [kernel_entry(), kernel_entry(OVERLAPPING, overlaps_previous=True,
                                                                cubin=NAME + ".cubin")])
    return isolated(f"""
        fake = ctypes.CDLL({str(libcuda)!r})
        launcher = L.Launcher({str(folder)!r}, 0)
        plain = lambda: ctypes.c_int.in_dll(fake, "fake_launches").value
        ex = lambda: ctypes.c_int.in_dll(fake, "fake_ex_launches").value if hasattr(fake, "fake_ex_launches") else 0
        attr = lambda: list((ctypes.c_int * 3).in_dll(fake, "fake_ex_attr"))
        counts = lambda: [plain(), ex()]
        after = launcher.prepare([({NAME!r}, (5, 1, 1), [L.Hole(0), 1, 1.0]),
                                  ({OVERLAPPING!r}, (3, 2, 1), [L.Hole(0), 2, 2.0])], ["q"])
        first = launcher.prepare([({OVERLAPPING!r}, (3, 2, 1), [L.Hole(0), 2, 2.0]),
                                  ({NAME!r}, (5, 1, 1), [L.Hole(0), 1, 1.0])], ["q"])
        out["after"] = [attempt(lambda: after.run([0x10], 99)), counts(), list((ctypes.c_uint * 7).in_dll(fake, "fake_dims"))]
        if ex():
            out["attr"] = attr()
        out["first"] = [attempt(lambda: first.run([0x10], 99)), counts()]
        out["alone"] = [attempt(lambda: launcher.launch({OVERLAPPING!r}, (1, 1, 1), [0x10, 1, 1.0], 99)), counts()]
    """, libcuda=libcuda)


def test_fake_driver_overlapping_launch(tmp_path, fake_libcuda_ex):
    """Only after another launch of a sequence does a kernel that waits for its predecessor go
    through cuLaunchKernelEx, asking for programmatic stream serialization (attribute 6)."""
    out = overlap_run(tmp_path, fake_libcuda_ex)
    assert out["after"] == [{"ok": None}, [1, 1], [3, 2, 1, 128, 1, 1, 65536]]
    assert out["attr"] == [1, 6, 1]
    assert out["first"] == [{"ok": None}, [3, 1]]  # first in its sequence: it waits in the stream
    assert out["alone"] == [{"ok": None}, [4, 1]]


def test_fake_driver_without_launch_ex_launches_plainly(tmp_path, fake_libcuda):
    """A driver without cuLaunchKernelEx (before CUDA 12): the same launches, each waiting for
    the one before (correct: the kernel's wait is then a no-op)."""
    out = overlap_run(tmp_path, fake_libcuda)
    assert out["after"][:2] == [{"ok": None}, [2, 0]]
    assert out["first"] == [{"ok": None}, [4, 0]] and out["alone"] == [{"ok": None}, [5, 0]]


def test_fake_driver_load_errors(tmp_path, fake_libcuda):
    elf = b"ELF not for this GPU"  # right sha256, but the fake driver rejects it like a wrong-arch cubin
    kernels = [kernel_entry("corrupt", sha="0" * 64), kernel_entry("missing"), kernel_entry("nobinary", data=elf),
               kernel_entry("noentry", entry="other")]
    folder = write_arch(tmp_path, kernels, cubins={"nobinary": elf})
    (folder / "missing.cubin").unlink()
    out = isolated(f"""
        launcher = L.Launcher({str(folder)!r}, 0)
        for name in ("corrupt", "missing", "nobinary", "noentry"):
            out[name] = attempt(lambda: launcher.launch(name, (1, 1, 1), [0, 1, 1.0], 0))
    """, libcuda=fake_libcuda)
    assert "corrupted artifact" in out["corrupt"]["error"] and "corrupt.cubin" in out["corrupt"]["error"]
    assert str(folder / "missing.cubin") in out["missing"]["error"] and out["missing"]["code"] == 2
    assert "cuModuleLoadData(nobinary.cubin) failed: CUDA_ERROR_NO_BINARY_FOR_GPU" in out["nobinary"]["error"]
    assert "cuModuleGetFunction(other in noentry.cubin) failed: CUDA_ERROR_NOT_FOUND" in out["noentry"]["error"]


# ---------------------------------------------------------------- real GPU

@gpu
def test_gpu_rejects_corrupted_cubin(tmp_path):
    launcher = Launcher(write_arch(tmp_path, [kernel_entry(sha="ab" * 32)]), 0)
    err = raises(lambda: launcher.launch(NAME, (1, 1, 1), [0, 1, 1.0], 0), "corrupted", NAME + ".cubin")
    assert err.code == 4


# ---------------------------------------------------------------- TMA descriptors (tensor-map parameters)

MAP_NAME = "tree_partial_tma"
TENSOR_MAP = {"data_type": 6, "elem_size": 2, "swizzle": 3, "box": [64, 64]}
MAP_PARAMS = [("k_pool", "nvTmaDesc"), ("k_pool_rows", "i32"), ("k_pool_cols", "i32"),
              ("k_pool_row_stride", "i64"), ("k_pool_col_stride", "i64")]


def map_entry(tensor_map=TENSOR_MAP, params=MAP_PARAMS):
    listed = [{"name": n, "type": t} for n, t in params + SCRATCH]
    for param in listed:
        if param["type"] == "nvTmaDesc" and tensor_map is not None:
            param["tensor_map"] = tensor_map
    return kernel_entry(MAP_NAME, params=listed, cubin=NAME + ".cubin")


@pytest.mark.parametrize("entry, fragments", [
    (map_entry(tensor_map=None), ["params[0].tensor_map", "is missing"]),
    (map_entry(tensor_map=[6]), ["params[0].tensor_map", "must be an object"]),
    (map_entry(tensor_map={**TENSOR_MAP, "box": [64, 300]}), ["tensor_map.box", "[1, 256]"]),
    (map_entry(tensor_map={**TENSOR_MAP, "box": [64]}), ["tensor_map.box"]),
    (map_entry(tensor_map={k: v for k, v in TENSOR_MAP.items() if k != "swizzle"}),
     ["tensor_map.swizzle", "missing"]),
    (map_entry(params=MAP_PARAMS[:4]), ["params[4].type", "must be i64", "'k_pool'"]),
    (map_entry(params=MAP_PARAMS[:1] + [("x", "i64")] + MAP_PARAMS[2:]), ["params[1].type", "must be i32"]),
    (map_entry(params=MAP_PARAMS * 5), ["more than 4 tensor maps"]),
])
def test_bad_tensor_map_params_are_refused(tmp_path, entry, fragments):
    raises(lambda: Launcher(write_arch(tmp_path, [entry]), 0), *fragments)


@pytest.mark.parametrize("view, fragments", [
    ([0, 256, 256, 1], ["tensor map 'k_pool' views 0 x 256"]),
    ([64, 256, 256, 2], ["strides (256, 2)", "column stride 1"]),
    ([64, 256, 200, 1], ["strides (200, 1)", "row stride >= cols"]),
    ([64, 4, 4, 1], ["multiple of 16"]),
])
def test_bad_tensor_map_views_are_refused_before_the_driver(tmp_path, view, fragments):
    launcher = Launcher(write_arch(tmp_path, [map_entry()]), 0)
    assert launcher.params(MAP_NAME) == MAP_PARAMS
    raises(lambda: launcher.launch(MAP_NAME, (1, 1, 1), [0x1000] + view, 0), *fragments)
    raises(lambda: launcher.prepare([(MAP_NAME, EMPTY, [Hole(0)] + view)], ["k"]), *fragments)
    raises(lambda: launcher.prepare([(MAP_NAME, EMPTY, [0x1008, 64, 256, 256, 1])], ["k"]),
           "argument 0 ('k_pool', nvTmaDesc) is 0x1008, not 16-byte aligned")


def test_fake_driver_encodes_tensor_maps_per_launch(tmp_path):
    """Each launch encodes the map from its address (a run's own pointer in a prepared sequence)
    and the view's fields, and passes the map where the parameter goes; an encoding error is the
    driver's, named; a driver without the entry point is refused by name."""
    folder = write_arch(tmp_path, [map_entry()])
    body = f"""
        fake = ctypes.CDLL(LIB)
        launcher = L.Launcher({str(folder)!r}, 0)
        params = lambda: bytes((ctypes.c_ubyte * 32).in_dll(fake, "fake_params")).hex()
        args = lambda: list((ctypes.c_ulonglong * 9).in_dll(fake, "fake_map_args"))
        out["launch"] = attempt(lambda: launcher.launch({MAP_NAME!r}, (1, 1, 1), [0x1000, 640, 1024, 1024, 1], 9))
        out["launch_params"], out["launch_map"] = params(), args()
        seq = launcher.prepare([({MAP_NAME!r}, (2, 1, 1), [L.Hole(0), 64, 256, 512, 1])], ["k"])
        out["run"] = attempt(lambda: seq.run([0x2000], 9))
        out["run_params"], out["run_map"] = params(), args()
        out["bad"] = attempt(lambda: seq.run([0xbad0], 9))
    """
    lib = build_fake_libcuda(tmp_path, "-DWITH_TENSOR_MAP")
    out = isolated(f"LIB = {str(lib)!r}\n" + textwrap.dedent(body), libcuda=lib)
    assert out["launch"] == out["run"] == {"ok": None}
    # fp16 (6), rank 2, the address, dims innermost first, the row stride in bytes, box cols then rows
    assert out["launch_map"] == [6, 2, 0x1000, 1024, 640, 2048, 64, 64, 3]
    assert out["run_map"] == [6, 2, 0x2000, 256, 64, 1024, 64, 64, 3]
    fields = (64).to_bytes(4, "little") + (256).to_bytes(4, "little") + (512).to_bytes(8, "little")
    fields += (1).to_bytes(8, "little")
    assert out["run_params"] == ((0x2001).to_bytes(8, "little") + fields).hex()  # the map, then the view
    assert "cuTensorMapEncodeTiled(" + MAP_NAME + ", 'k_pool')" in out["bad"]["error"]
    plain = isolated(f"""
        launcher = L.Launcher({str(folder)!r}, 0)
        out["launch"] = attempt(lambda: launcher.launch({MAP_NAME!r}, (1, 1, 1), [0x1000, 64, 256, 256, 1], 9))
    """, libcuda=build_fake_libcuda(tmp_path))
    assert "no cuTensorMapEncodeTiled" in plain["launch"]["error"] and plain["launch"]["code"] == 5
