"""Tests of the C ABI (csrc/capi, libflash_reasoning.so) through cffi, from the header text.

CPU: the header parses, the exports are exactly its functions, every bad argument gives its
status and message and leaves ``*out`` untouched, host-only contexts plan as Python plans.
Driver tests run in a fresh interpreter (libcuda is loaded once per process): with no
libcuda, and with test_launcher's fake driver (device memory is host memory there), which
is enough to create, update and reject plans. GPU: the cffi path against the Python API and
the float64 reference.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import gpu, poisoned_like
from flash_reasoning import capi, reference, runtime
from flash_reasoning.planner import PlanOptions
from test_launcher import fake_libcuda, isolated  # noqa: F401 (fake_libcuda is a fixture)

cffi = pytest.importorskip("cffi")

FR_OK, FR_INVALID_ARGUMENT, FR_NOT_FOUND, FR_INVALID_MANIFEST, FR_IO_ERROR = 0, 1, 2, 3, 8
FR_DRIVER_UNAVAILABLE, FR_CUDA_ERROR, FR_PLAN_MISMATCH, FR_UNSUPPORTED = 5, 6, 10, 11
FR_FLOAT16, FR_BFLOAT16 = 1, 2
# Host-only contexts read this folder (sm90 unless a GPU check built another arch alone);
# they plan for 132 SMs whatever the arch.
ARCH = runtime.available_archs()[-1]
SENTINEL = 0x5EED  # what a failed call must leave in *out
SEED_SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=FR_FLOAT16, block_size=16,
                  num_blocks=4096, sm_scale=0.0)


class CApi:
    """The library opened through cffi from the header text, plus what the tests share
    (also imported by the fresh interpreters of the driver tests)."""

    def __init__(self):
        self.ffi = cffi.FFI()
        self.ffi.cdef(capi.cdef_text())
        self.lib = self.ffi.dlopen(str(capi.library_path()))

    def error(self) -> str:
        return self.ffi.string(self.lib.frGetLastError()).decode()

    def call(self, name: str, *args) -> tuple[int, str]:
        """(status, last error) of one call."""
        return int(getattr(self.lib, name)(*args)), self.error()

    def out(self, ctype: str):
        """An out-parameter holding SENTINEL, to see that a failed call leaves it alone."""
        box = self.ffi.new(ctype + "*")
        box[0] = self.ffi.cast(ctype, SENTINEL)
        return box

    def untouched(self, box) -> bool:
        return int(self.ffi.cast("uintptr_t", box[0])) == SENTINEL

    def host_context(self, root=None, arch=ARCH):
        box = self.out("frContext")
        rc, msg = self.call("frContextCreateHostOnly", str(root or capi.artifact_root()).encode(), arch.encode(), box)
        assert rc == FR_OK, msg
        return box[0]

    def plan(self, context, problem: "Problem"):
        """(status, message, plan handle or None); frPlanCreateWithDraftMasks for a problem with drafts."""
        box = self.out("frPlan")
        if problem.drafts is None:
            rc, msg = self.call("frPlanCreate", context, problem.shape_c(self), problem.tree_c(self), problem.extra,
                                box)
        else:
            drafts = np.ascontiguousarray(problem.drafts, np.int64)
            problem._keep.append(drafts)
            rc, msg = self.call("frPlanCreateWithDraftMasks", context, problem.shape_c(self), problem.tree_c(self),
                                self.ffi.cast("frDraftMask*", self.ffi.from_buffer(drafts)), problem.extra, box)
        assert (rc == FR_OK) != self.untouched(box), "a failed frPlanCreate must leave *out untouched"
        return rc, msg, box[0] if rc == FR_OK else None

    def info(self, plan) -> dict:
        info = self.ffi.new("frPlanInfo*")
        rc, msg = self.call("frPlanGetInfo", plan, info)
        assert rc == FR_OK, msg
        return {name: getattr(info, name) for name in dir(info)}

    def pointer(self, address: int):
        return self.ffi.cast("void*", address)


@dataclass
class Problem:
    """One frPlanCreate call's arguments as numpy arrays and a dict, easy to spoil."""
    lengths: np.ndarray
    tables: np.ndarray
    shape: dict = field(default_factory=lambda: dict(SEED_SHAPE))
    stride: int = 0  # 0: the tables' width
    num_branches: int | None = None  # None: len(lengths)
    extra: int = 1
    drafts: np.ndarray | None = None  # int64 [num_branches, 2]: frDraftMask's fields per row
    _keep: list = field(default_factory=list)

    def shape_c(self, api: CApi):
        return api.ffi.new("frAttentionShape*", self.shape)

    def tree_c(self, api: CApi):
        """An frTree pointing into arrays this problem owns: keep the problem alive with it."""
        lengths = np.ascontiguousarray(self.lengths, np.int32)
        tables = np.ascontiguousarray(self.tables, np.int32)
        self._keep += [lengths, tables]  # alive as long as the problem
        return api.ffi.new("frTree*", dict(
            num_branches=len(lengths) if self.num_branches is None else self.num_branches,
            lengths=api.ffi.from_buffer("int32_t[]", lengths), block_tables=api.ffi.from_buffer("int32_t[]", tables),
            table_stride=self.stride or tables.shape[1]))


SPARE_COLUMNS = 2  # table columns beyond the leaves, for updates that grow (or outgrow) a plan


def shared_root(num_branches: int, root: int, leaf: int, block_size: int = 16) -> Problem:
    """A root of `root` tokens (a multiple of block_size) in blocks 0.. shared by every branch,
    then each branch's `leaf` tokens in its own blocks, then SPARE_COLUMNS own blocks more."""
    root_blocks, own_blocks = root // block_size, -(-leaf // block_size) + SPARE_COLUMNS
    tables = np.zeros((num_branches, root_blocks + own_blocks), np.int32)
    tables[:, :root_blocks] = np.arange(root_blocks)
    tables[:, root_blocks:] = root_blocks + np.arange(num_branches * own_blocks).reshape(num_branches, own_blocks)
    return Problem(np.full(num_branches, root + leaf, np.int32), tables)


def entry(row: int, column: int, block: int):
    """A spoiler: one table entry changed."""
    return lambda problem: problem.tables.__setitem__((row, column), block)


def length(row: int, tokens: int):
    return lambda problem: problem.lengths.__setitem__(row, tokens)


@pytest.fixture(scope="module")
def api():
    return CApi()


@pytest.fixture(scope="module")
def host_context(api):
    context = api.host_context()
    yield context
    api.lib.frContextDestroy(context)


def header_functions() -> set[str]:
    return set(re.findall(r"^\S[^(;]*\b(fr[A-Z]\w*)\(", capi.header_path().read_text(), re.M))


# ---------------------------------------------------------------- the header and the library

def test_header_declares_exactly_the_exports(api):
    declared = header_functions()
    assert len(declared) >= 20 and all(getattr(api.lib, name) for name in declared)
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("no nm to list the library's exports")
    listing = subprocess.run([nm, "-D", "--defined-only", str(capi.library_path())], capture_output=True,
                             text=True, check=True).stdout
    assert {line.split()[-1] for line in listing.splitlines()} == declared


def test_version_and_status_names(api):
    import flash_reasoning
    assert api.ffi.string(api.lib.frVersion()).decode() == flash_reasoning.__version__
    statuses = api.ffi.typeof("frStatus").relements  # name -> value, as cffi read the header
    assert len(statuses) == 12 and statuses["FR_UNSUPPORTED"] == FR_UNSUPPORTED
    for name, value in statuses.items():
        assert api.ffi.string(api.lib.frStatusName(value)).decode() == name
    assert api.ffi.string(api.lib.frStatusName(99)).decode() == "FR_UNKNOWN_STATUS"


# ---------------------------------------------------------------- contexts

def test_context_null_arguments(api):
    root = str(capi.artifact_root()).encode()
    box = api.out("frContext")
    for name, args in [("frContextCreate", (api.ffi.NULL, 0, box)), ("frContextCreate", (root, 0, api.ffi.NULL)),
                       ("frContextCreateHostOnly", (root, api.ffi.NULL, box)),
                       ("frContextCreateHostOnly", (api.ffi.NULL, b"sm90", box))]:
        rc, msg = api.call(name, *args)
        assert rc == FR_INVALID_ARGUMENT and "must not be NULL" in msg, (name, msg)
    assert api.untouched(box)
    assert api.call("frContextArch", api.ffi.NULL, api.ffi.new("char**"))[0] == FR_INVALID_ARGUMENT
    assert api.call("frContextDestroy", api.ffi.NULL) == (FR_OK, "")


def test_host_context_arch(api, host_context):
    arch = api.ffi.new("char**")
    assert api.call("frContextArch", host_context, arch)[0] == FR_OK
    assert api.ffi.string(arch[0]).decode() == ARCH


def test_host_context_missing_arch(api, tmp_path):
    box = api.out("frContext")
    rc, msg = api.call("frContextCreateHostOnly", str(tmp_path).encode(), b"sm90", box)
    assert rc == FR_NOT_FOUND and str(tmp_path / "sm90") in msg and api.untouched(box)


def test_manifest_of_another_version(api, tmp_path):
    shutil.copytree(capi.artifact_root() / ARCH, tmp_path / ARCH)
    manifest = json.loads((tmp_path / ARCH / "manifest.json").read_text())
    manifest["package_version"] = "0.0.1"
    (tmp_path / ARCH / "manifest.json").write_text(json.dumps(manifest))
    box = api.out("frContext")
    rc, msg = api.call("frContextCreateHostOnly", str(tmp_path).encode(), ARCH.encode(), box)
    assert rc == FR_INVALID_MANIFEST and "'0.0.1'" in msg and "0.1.0" in msg and api.untouched(box)


def arch_root(tmp_path):
    """An artifact root holding ARCH, with ARCH beside it too (where "../ARCH" would lead)."""
    root = tmp_path / "root"
    root.mkdir()
    for folder in (root / ARCH, tmp_path / ARCH):
        folder.symlink_to(capi.artifact_root() / ARCH, target_is_directory=True)
    return root


@pytest.mark.parametrize("arch", ["../" + ARCH, ARCH + "/", "/" + ARCH, f"{ARCH}/../{ARCH}", "./" + ARCH, "", "sm",
                                  ARCH.upper(), "sm9a", "sm 90", ARCH + "\n", "sm" + "9" * 12])
def test_host_context_refuses_a_malformed_arch(api, tmp_path, arch):
    """An arch is "sm" and digits, the name of a folder directly under the artifact root."""
    root = arch_root(tmp_path)
    assert api.call("frContextCreateHostOnly", str(root).encode(), ARCH.encode(), api.out("frContext"))[0] == FR_OK
    box = api.out("frContext")
    rc, msg = api.call("frContextCreateHostOnly", str(root).encode(), arch.encode(), box)
    assert rc == FR_INVALID_ARGUMENT and api.untouched(box), msg
    assert msg.startswith("arch must be 'sm' followed by digits") and f"got '{arch}'" in msg, msg


def test_host_context_refuses_a_manifest_of_another_arch(api, tmp_path):
    folder = tmp_path / ("sm80" if ARCH != "sm80" else "sm89")
    folder.mkdir()
    shutil.copy(capi.artifact_root() / ARCH / "manifest.json", folder)
    box = api.out("frContext")
    rc, msg = api.call("frContextCreateHostOnly", str(tmp_path).encode(), folder.name.encode(), box)
    assert rc == FR_INVALID_MANIFEST and api.untouched(box), msg
    assert str(folder / "manifest.json") in msg and f"arch '{ARCH}'" in msg and f"folder '{folder.name}'" in msg


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_host_context_refuses_a_manifest_that_is_not_a_regular_file(tmp_path, kind):
    """A FIFO would block the open forever, /dev/zero be read until memory runs out."""
    manifest = tmp_path / ARCH / "manifest.json"
    manifest.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero")
    out = misuse(f"""
        box = ffi.new("frContext*", ffi.cast("frContext", 0x5EED))
        out["create"] = call("frContextCreateHostOnly", {str(tmp_path).encode()!r}, ARCH, box)
        out["untouched"] = int(ffi.cast("uintptr_t", box[0])) == 0x5EED
    """)
    status, message = out["create"]
    what = {"fifo": "is a FIFO", "dev_zero": "is a character device"}[kind]
    assert status == FR_IO_ERROR and f"manifest {manifest} {what}, not a regular file" in message, message
    assert out["untouched"]


def test_calls_refuse_null_outputs_and_bad_sizes(api, host_context):
    _, _, plan = api.plan(host_context, small_problem())
    shape, null = api.ffi.new("frAttentionShape*", SEED_SHAPE), api.ffi.NULL
    calls = [
        ("frContextArch", (host_context, null), "arch must not be NULL"),
        ("frPlanGetInfo", (plan, null), "info must not be NULL"),
        ("frPlanKernelName", (plan, 0, null), "name must not be NULL"),
        ("frDeviceAlloc", (host_context, 64, null), "ptr must not be NULL"),
        ("frCopyToHost", (host_context, null, api.pointer(256), 8), "dst and src must not be NULL"),
        ("frCopyToDevice", (host_context, api.pointer(256), null, 8), "dst and src must not be NULL"),
        ("frPagedDecodeWorkspaceSize", (host_context, shape, 2, 4, null), "bytes must not be NULL"),
        ("frPagedDecodeWorkspaceSize", (host_context, null, 2, 4, api.ffi.new("size_t*")), "shape must not be NULL"),
        ("frPagedDecodeWorkspaceSize", (host_context, shape, -1, 4, api.ffi.new("size_t*")), "num_seqs must be in [0, 2^31), got -1"),
        ("frPagedDecodeWorkspaceSize", (host_context, shape, 2, 0, api.ffi.new("size_t*")),
         "max_blocks must be in [1, 2^31), got 0"),
        # Sizes the kernels cannot index in int32 are refused here, as frPagedDecode refuses them.
        ("frPagedDecodeWorkspaceSize", (host_context, shape, 1, 2**31 - 1, api.ffi.new("size_t*")),
         "tokens per sequence: the kernels index tokens in int32"),
        ("frPagedDecodeWorkspaceSize", (host_context, shape, 2**31 - 1, 2, api.ffi.new("size_t*")),
         "the kernels index them in int32"),
        ("frPagedDecodeWorkspaceSize", (host_context, api.ffi.new("frAttentionShape*", dict(SEED_SHAPE, dtype=0)),
                                        2, 4, api.ffi.new("size_t*")), "frDtype 0"),
    ]
    for name, args, fragment in calls:
        rc, msg = api.call(name, *args)
        assert rc == FR_INVALID_ARGUMENT and fragment in msg, (name, msg)
    api.lib.frPlanDestroy(plan)


# ---------------------------------------------------------------- handles: misuse is an error, never a crash

# A fresh interpreter without torch (a fraction of a second to start): a crash there fails
# one test instead of ending the run. Every context call and every plan call with valid
# arguments apart from the handle, so each test tries them all.
MISUSE_PRELUDE = """
import json, threading, cffi, numpy as np
ffi = cffi.FFI()
ffi.cdef(CDEF)
lib = ffi.dlopen(LIBRARY)
NULL, p = ffi.NULL, ffi.cast("void*", 256)
keep = []
out = {}

def call(name, *args):
    return [int(getattr(lib, name)(*args)), ffi.string(lib.frGetLastError()).decode()]

def context(library=lib):
    box = ffi.new("frContext*")
    assert library.frContextCreateHostOnly(ROOT, ARCH, box) == 0
    return box[0]

def tree_c(branches=4):
    lengths = np.full(branches, 80, np.int32)  # a 64-token root in blocks 0-3, one own block each
    tables = np.zeros((branches, 7), np.int32)
    tables[:, :4] = np.arange(4)
    tables[:, 4] = 4 + np.arange(branches)
    keep.extend([lengths, tables])
    return ffi.new("frTree*", dict(num_branches=branches, lengths=ffi.from_buffer("int32_t[]", lengths),
                                   block_tables=ffi.from_buffer("int32_t[]", tables), table_stride=7))

SHAPE = ffi.new("frAttentionShape*", SHAPE_FIELDS)

def plan(ctx, library=lib):
    box = ffi.new("frPlan*")
    assert library.frPlanCreate(ctx, SHAPE, tree_c(), 1, box) == 0
    return box[0]

def context_calls(ctx):
    return {
        "frContextArch": (ctx, ffi.new("char**")),
        "frPlanCreate": (ctx, SHAPE, tree_c(), 1, ffi.new("frPlan*")),
        "frPlanCreateWithDraftMasks": (ctx, SHAPE, tree_c(), NULL, 1, ffi.new("frPlan*")),
        "frAppendKV": (ctx, p, p, p, p, p, 1, 8, 128, NULL),
        "frPagedDecodeWorkspaceSize": (ctx, SHAPE, 1, 4, ffi.new("size_t*")),
        "frPagedDecode": (ctx, SHAPE, p, p, p, p, p, 1, 4, p, NULL, 0, NULL),
        "frDeviceAlloc": (ctx, 64, ffi.new("void**")),
        "frDeviceFree": (ctx, p),
        "frCopyToDevice": (ctx, p, ffi.new("char[8]"), 8),
        "frCopyToHost": (ctx, ffi.new("char[8]"), p, 8),
        "frStreamSynchronize": (ctx, NULL),
        "frContextDestroy": (ctx,),
    }

def plan_calls(plan):
    return {
        "frPlanGetInfo": (plan, ffi.new("frPlanInfo*")),
        "frPlanKernelName": (plan, 0, ffi.new("char**")),
        "frPlanRun": (plan, p, p, p, p, NULL),
        "frPlanUpdate": (plan, tree_c(), NULL),
        "frPlanDestroy": (plan,),
    }

def try_all(calls, prefix=""):
    for name, args in calls.items():
        out[prefix + name] = call(name, *args)
"""


def misuse(body: str, library=None) -> dict:
    """Runs `body` after MISUSE_PRELUDE in a fresh interpreter (no libcuda: host-only contexts);
    returns the dict `out` it fills. A crash or a hang fails the test."""
    constants = {"CDEF": capi.cdef_text(), "LIBRARY": str(library or capi.library_path()),
                 "ROOT": str(capi.artifact_root()).encode(), "ARCH": ARCH.encode(), "SHAPE_FIELDS": SEED_SHAPE}
    script = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    script += MISUSE_PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FLASH_REASONING_LIBCUDA": "/nonexistent/libcuda"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, f"exit status {proc.returncode} (negative: killed by that signal)\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def functions_taking(parameter: str) -> set[str]:
    """The header's functions with a parameter `parameter` (e.g. "frPlan plan")."""
    text = " ".join(capi.header_path().read_text().split())
    return {name for name, params in re.findall(r"\b(fr[A-Z]\w*)\(([^)]*)\)", text) if parameter in params}


def refused(result, handle: str, *fragments) -> bool:
    status, message = result
    return status == FR_INVALID_ARGUMENT and message.startswith(handle + " 0x") and all(f in message for f in fragments)


def test_misuse_tries_every_call_with_a_handle():
    calls = misuse("""
        ctx = context()
        out["context"], out["plan"] = list(context_calls(ctx)), list(plan_calls(plan(ctx)))
    """)
    assert set(calls["context"]) == functions_taking("frContext context")
    assert set(calls["plan"]) == functions_taking("frPlan plan")


def test_destroyed_context_is_refused_by_every_call():
    out = misuse("""
        ctx = context()
        out["destroy"] = call("frContextDestroy", ctx)
        try_all(context_calls(ctx))
        box = ffi.new("frPlan*", ffi.cast("frPlan", 0x5EED))
        out["plan_untouched"] = [call("frPlanCreate", ctx, SHAPE, tree_c(), 1, box)[0],
                                 int(ffi.cast("uintptr_t", box[0]))]
    """)
    assert out.pop("destroy") == [FR_OK, ""]
    assert out.pop("plan_untouched") == [FR_INVALID_ARGUMENT, 0x5EED]
    for name, result in out.items():  # frContextDestroy among them: destroyed twice
        assert refused(result, "context", "was destroyed"), (name, result)


def test_destroyed_plan_is_refused_by_every_call():
    out = misuse("""
        ctx = context()
        doomed = plan(ctx)
        out["destroy"] = call("frPlanDestroy", doomed)
        try_all(plan_calls(doomed))
        info = ffi.new("frPlanInfo*", dict(num_branches=-7))
        out["info_untouched"] = [call("frPlanGetInfo", doomed, info)[0], info.num_branches]
        out["context_lives"] = call("frContextArch", ctx, ffi.new("char**"))
    """)
    assert out.pop("destroy") == [FR_OK, ""] and out.pop("context_lives") == [FR_OK, ""]
    assert out.pop("info_untouched") == [FR_INVALID_ARGUMENT, -7]
    for name, result in out.items():  # frPlanDestroy among them: destroyed twice
        assert refused(result, "plan", "was destroyed"), (name, result)


def test_destroying_a_context_destroys_its_plans():
    out = misuse("""
        first, second = context(), context()
        doomed, survivor = [plan(first), plan(first)], plan(second)
        out["destroy"] = call("frContextDestroy", first)
        for i, handle in enumerate(doomed):
            try_all(plan_calls(handle), prefix=f"{i}:")
        out["survivor"] = call("frPlanGetInfo", survivor, ffi.new("frPlanInfo*"))
        out["survivor_destroy"] = call("frPlanDestroy", survivor)
        out["second_destroy"] = call("frContextDestroy", second)
    """)
    for key in ("destroy", "survivor", "survivor_destroy", "second_destroy"):
        assert out.pop(key) == [FR_OK, ""], key
    assert len(out) == 10
    for name, result in out.items():
        assert refused(result, "plan", "was destroyed", "with its context"), (name, result)


def test_garbage_and_foreign_handles_are_refused(tmp_path):
    """Values the library never issued: small numbers, all ones, the address of live memory
    (never read: it is not a handle), a plan passed as a context and the reverse, and the
    handles of a second copy of the library loaded in the same process."""
    copy = tmp_path / "libflash_reasoning_copy.so"
    shutil.copy(capi.library_path(), copy)
    out = misuse(f"""
        ctx = context()
        real_plan = plan(ctx)
        other = ffi.dlopen({str(copy)!r})
        other_ctx = context(other)
        other_plan = plan(other_ctx, other)
        memory = ffi.new("char[4096]", b"\\xff" * 4096)
        garbage = {{"small": 0x5EED, "one": 1, "ones": 2**64 - 1, "memory": int(ffi.cast("uintptr_t", memory))}}
        for label, value in garbage.items():
            try_all(context_calls(ffi.cast("frContext", value)), prefix=f"context {{label}}:")
            try_all(plan_calls(ffi.cast("frPlan", value)), prefix=f"plan {{label}}:")
        try_all(context_calls(ffi.cast("frContext", real_plan)), prefix="context kind:")
        try_all(plan_calls(ffi.cast("frPlan", ctx)), prefix="plan kind:")
        try_all(context_calls(other_ctx), prefix="context foreign:")
        try_all(plan_calls(other_plan), prefix="plan foreign:")
        out["still_fine"] = [call("frPlanGetInfo", real_plan, ffi.new("frPlanInfo*")), call("frContextDestroy", ctx),
                             other.frPlanDestroy(other_plan), other.frContextDestroy(other_ctx)]
    """)
    assert out.pop("still_fine") == [[FR_OK, ""], [FR_OK, ""], FR_OK, FR_OK]
    assert len(out) == 6 * 17
    for name, result in out.items():
        handle, kind = name.split(":")[0].split()
        expected = {"context kind": "is a plan handle, not a context",
                    "plan kind": "is a context handle, not a plan"}.get(f"{handle} {kind}",
                                                                        "is not a handle this library issued")
        assert refused(result, handle, expected), (name, result)


def test_threads_sharing_a_context_while_it_is_destroyed():
    """Eight threads plan, inspect and destroy plans on one context while the main thread
    destroys it: every call is FR_OK or says the handle was destroyed."""
    out = misuse("""
        ctx = context()
        results = []
        def worker():
            for _ in range(200):
                box = ffi.new("frPlan*")
                got = [call("frPlanCreate", ctx, SHAPE, tree_c(), 1, box)]
                if got[0][0] == 0:
                    got += [call("frPlanGetInfo", box[0], ffi.new("frPlanInfo*")),
                            call("frPlanKernelName", box[0], 0, ffi.new("char**")),
                            call("frPlanDestroy", box[0])]
                results.extend(got)
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        import time
        time.sleep(0.05)
        out["destroy"] = call("frContextDestroy", ctx)
        for t in threads:
            t.join()
        out["ok"] = sum(r[0] == 0 for r in results)
        out["refused"] = sorted({r[1].split(" ", 2)[-1] for r in results if r[0] != 0})
        out["statuses"] = sorted({r[0] for r in results})
    """)
    assert out["destroy"] == [FR_OK, ""] and out["ok"] > 0
    assert set(out["statuses"]) <= {FR_OK, FR_INVALID_ARGUMENT}, out
    assert all(reason.startswith("was destroyed") for reason in out["refused"]), out["refused"]


# ---------------------------------------------------------------- plans: validation (host-only)

SMALL_BRANCHES = 256


def small_problem() -> Problem:
    """256 branches of 80 tokens: a 64-token root (blocks 0-3), 16 own tokens each (column 4);
    tables 7 wide; extra_blocks 1, so plans hold 6 columns. The plan reads the root once per
    final program of 8 sibling lanes (a flat plan with shared ranges: a walk of 3 KV tiles,
    one launch), so blocks 0-3 lie in a range the plan shares."""
    return shared_root(SMALL_BRANCHES, root=64, leaf=16)


@pytest.mark.parametrize("spoil, status, fragments", [
    (lambda p: p.shape.update(dtype=7), FR_INVALID_ARGUMENT, ["shape.dtype", "frDtype 7"]),
    (lambda p: p.shape.update(head_dim=96), FR_UNSUPPORTED, ["head_dim 96", f"not compiled for {ARCH}",
                                                             "compiled head_dims: 64, 128, 256"]),
    (lambda p: p.shape.update(num_qo_heads=12), FR_INVALID_ARGUMENT, ["shape.num_qo_heads", "multiple", "got 12"]),
    (lambda p: p.shape.update(num_kv_heads=0), FR_INVALID_ARGUMENT, ["shape.num_kv_heads", "got 0"]),
    (lambda p: p.shape.update(block_size=0), FR_INVALID_ARGUMENT, ["shape.block_size"]),
    (lambda p: p.shape.update(sm_scale=float("nan")), FR_INVALID_ARGUMENT, ["shape.sm_scale", "finite"]),
    (lambda p: p.shape.update(sm_scale=-1e38), FR_INVALID_ARGUMENT, ["shape.sm_scale", "at most"]),
    (length(1, -1), FR_INVALID_ARGUMENT, ["tree.lengths[1]", "got -1"]),
    (entry(1, 2, 4096), FR_INVALID_ARGUMENT, ["block_tables[1][2] is 4096", "shape.num_blocks = 4096"]),
    (entry(2, 4, -3), FR_INVALID_ARGUMENT, ["block_tables[2][4] is -3"]),
    (lambda p: setattr(p, "stride", 4), FR_INVALID_ARGUMENT, ["5 blocks", "tree.table_stride is 4"]),
    (lambda p: setattr(p, "num_branches", -1), FR_INVALID_ARGUMENT, ["tree.num_branches", "got -1"]),
    (lambda p: setattr(p, "extra", -1), FR_INVALID_ARGUMENT, ["extra_blocks", "got -1"]),
])
def test_plan_create_rejects(api, host_context, spoil, status, fragments):
    problem = small_problem()
    assert api.plan(host_context, problem)[0] == FR_OK  # unspoilt, it plans
    spoil(problem)
    rc, msg, _ = api.plan(host_context, problem)
    assert rc == status, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_plan_create_null_arguments(api, host_context):
    problem = small_problem()
    shape, tree, box = problem.shape_c(api), problem.tree_c(api), api.out("frPlan")
    null = api.ffi.NULL
    for args, fragment in [((null, shape, tree, 1, box), "context"), ((host_context, null, tree, 1, box), "shape"),
                           ((host_context, shape, null, 1, box), "tree"),
                           ((host_context, shape, tree, 1, null), "out")]:
        rc, msg = api.call("frPlanCreate", *args)
        assert rc == FR_INVALID_ARGUMENT and fragment in msg and "NULL" in msg, msg
    empty_lengths = api.ffi.new("frTree*", dict(num_branches=2, lengths=null, block_tables=null, table_stride=4))
    rc, msg = api.call("frPlanCreate", host_context, shape, empty_lengths, 1, box)
    assert rc == FR_INVALID_ARGUMENT and "tree.lengths and tree.block_tables" in msg
    assert api.untouched(box)
    assert api.call("frPlanGetInfo", null, api.ffi.new("frPlanInfo*"))[0] == FR_INVALID_ARGUMENT
    assert api.call("frPlanDestroy", null) == (FR_OK, "")


def test_host_only_context_refuses_device_work(api, host_context):
    _, _, plan = api.plan(host_context, small_problem())
    problem, p, out = small_problem(), api.pointer(256), api.pointer(1 << 32)  # out apart from q
    shape = problem.shape_c(api)
    calls = {
        "frPlanRun": (plan, p, p, p, out, api.ffi.NULL),
        "frPlanUpdate": (plan, problem.tree_c(api), api.ffi.NULL),
        "frAppendKV": (host_context, p, p, p, p, p, 1, 8, 128, api.ffi.NULL),
        "frPagedDecode": (host_context, shape, p, p, p, p, p, 1, 4, out, api.ffi.NULL, 0, api.ffi.NULL),
        "frDeviceAlloc": (host_context, 64, api.ffi.new("void**")),
        "frCopyToDevice": (host_context, p, api.ffi.new("char[8]"), 8),
        "frStreamSynchronize": (host_context, api.ffi.NULL),
    }
    for name, args in calls.items():
        rc, msg = api.call(name, *args)
        assert rc == FR_DRIVER_UNAVAILABLE and "needs a GPU" in msg and "host-only" in msg, (name, msg)
    api.lib.frPlanDestroy(plan)


# ---------------------------------------------------------------- plans: what they decide (host-only)

def test_seed_tree_plan_info(api, host_context):
    problem = shared_root(256, root=2048, leaf=64)
    rc, msg, plan = api.plan(host_context, problem)
    assert rc == FR_OK, msg
    info = api.info(plan)
    workspace = info.pop("workspace_bytes")
    assert info == dict(num_branches=256, num_nodes=257, computed_nodes=1, num_launches=2,
                        max_blocks=2048 // 16 + 4 + problem.extra, unique_tokens=2048 + 256 * 64,
                        logical_tokens=256 * (2048 + 64))
    assert workspace >= 256 * 32 * 128 * 4  # at least the root's fp32 partials
    api.lib.frPlanDestroy(plan)


@pytest.mark.parametrize("seed", range(7))
def test_planner_agrees_with_python(api, host_context, seed):
    """Small random trees plan flat (sharing does not repay a partial launch there), the
    seed-like tree (48 leaves under a 1000-token root) a tree: the C ABI decides as Python."""
    from flash_reasoning import PhysicalKVAllocator, TreeAttentionPlan
    from flash_reasoning.tools.synthetic import random_branches
    if seed == 6:
        alloc, ids = seed_like_tree(torch.float16, 64, device="cpu")
    else:
        alloc = PhysicalKVAllocator(1024, 16, 2, 64, device="cpu")
        ids = random_branches(alloc, 24, 3, 200, seed=seed, roots=1 + seed % 2)
    tables, lengths = alloc.block_tables(ids)
    num_qo_heads = 4 * alloc.num_kv_heads
    problem = allocator_problem(alloc, ids, num_qo_heads)
    rc, msg, plan = api.plan(host_context, problem)
    assert rc == FR_OK, msg
    python = TreeAttentionPlan(alloc, ids, num_qo_heads,
                               _options=PlanOptions(num_sms=132))  # its tree: fork histories
    tree = alloc.segment_tree(ids)
    info = api.info(plan)
    assert (info["computed_nodes"] > 0) == (seed == 6)
    assert (info["num_nodes"], info["computed_nodes"], info["num_launches"], info["unique_tokens"],
            info["logical_tokens"]) == (tree.num_nodes, python.arrays.stats["computed_nodes"],
                                        len(python.arrays.items) + 1, int((tree.node_end - tree.node_start).sum()),
                                        int(lengths.sum()))
    api.lib.frPlanDestroy(plan)


def query_row_problem(alloc, ids, q_lens, num_qo_heads: int) -> Problem:
    """Several queries per branch as the C ABI takes them (capi.md): one row per query, its
    branch's block table, its causal length."""
    from flash_reasoning.segment_tree import query_rows
    tables, lengths = alloc.block_tables(ids)
    branch, offset = query_rows(np.asarray(q_lens))
    problem = allocator_problem(alloc, ids, num_qo_heads)
    return Problem(lengths.cpu().numpy()[branch] + offset, tables.cpu().numpy()[branch],
                   extra=2, shape=problem.shape)


@pytest.mark.parametrize("queries, heads, tiles", [(lambda i: (i * 7) % 13, 8, False),
                                                   (lambda i: 12 + i % 5, 32, True)])
def test_query_rows_plan_as_python_plans_q_lens(api, host_context, queries, heads, tiles):
    """A frTree of query rows is planned as Python plans the same q_lens: a tree plan, or
    query tiles (a branch's rows list the same blocks) with the same kernel."""
    from flash_reasoning import TreeAttentionPlan
    alloc, ids = seed_like_tree(torch.float16, 64, device="cpu")
    q_lens = [queries(i) for i in range(len(ids))]
    rc, msg, plan = api.plan(host_context, query_row_problem(alloc, ids, q_lens, heads))
    assert rc == FR_OK, msg
    python = TreeAttentionPlan(alloc, ids, heads, q_lens=q_lens,
                               _options=PlanOptions(num_sms=132, arch=ARCH))
    tree = alloc.segment_tree(ids, q_lens)
    info = api.info(plan)
    assert (info["num_branches"], info["num_nodes"], info["computed_nodes"],
            info["num_launches"], info["logical_tokens"]) == (
        sum(q_lens), tree.num_nodes, python.arrays.stats["computed_nodes"],
        len(python.arrays.items) + 1, int(tree.lengths.sum()))
    assert (python.arrays.query_tiles.size > 0) == tiles
    if tiles:
        assert kernel_names(api, plan) == python.kernels
    api.lib.frPlanDestroy(plan)


def draft_row_problem(alloc, ids, q_lens, mask, num_qo_heads: int) -> Problem:
    """Draft masks as the C ABI takes them (capi.md): one row per query, its branch's block
    table; a masked branch's query j a row ending at its last allowed draft token, its
    frDraftMask {draft tokens in the row, bits}; a causal one's its causal length, {0, 0}."""
    from flash_reasoning.ops.checks import check_masks
    from flash_reasoning.ops.tree_attention import draft_masks
    problem = query_row_problem(alloc, ids, q_lens, num_qo_heads)
    q_lens = np.asarray(q_lens)
    masks = check_masks(mask, q_lens, 64)
    drafts = draft_masks(masks, q_lens)
    rows = np.repeat(np.arange(len(ids)), q_lens)
    context = (alloc.lengths(ids) - q_lens)[rows]
    problem.lengths = np.where(np.isin(rows, list(masks)), context + drafts[:, 0], problem.lengths)
    problem.drafts = drafts
    return problem


def test_draft_rows_plan_as_python_plans_masks(api, host_context):
    """A frTree of draft rows with their frDraftMasks is planned as Python plans the same
    q_lens and masks (its causal rows unrounded): the same tree, launches and kernels."""
    from test_tree_attention import random_masks

    from flash_reasoning import TreeAttentionPlan
    alloc, ids = seed_like_tree(torch.float16, 64, device="cpu")
    q_lens = [(i * 7) % 13 for i in range(len(ids))]
    mask = random_masks(q_lens, 3)
    rc, msg, plan = api.plan(host_context, draft_row_problem(alloc, ids, q_lens, mask, 8))
    assert rc == FR_OK, msg
    python = TreeAttentionPlan(alloc, ids, 8, q_lens=q_lens, mask=mask,  # causal rows exact, as C's
                               _options=PlanOptions(num_sms=132, arch=ARCH, query_block=1))
    info = api.info(plan)
    assert (info["num_branches"], info["num_nodes"], info["computed_nodes"], info["num_launches"]) == (
        sum(q_lens), python.arrays.stats["nodes"], python.arrays.stats["computed_nodes"], len(python.kernels))
    assert kernel_names(api, plan) == python.kernels
    assert "_draft1_" in python.kernels[-1]
    api.lib.frPlanDestroy(plan)


@pytest.mark.parametrize("spoil, match", [
    (lambda d, lengths: d.__setitem__((0, 0), 65), r"draft_masks\[0\]\.tokens must be in \[0, 64\], got 65"),
    (lambda d, lengths: d.__setitem__((1, 0), -1), r"draft_masks\[1\]\.tokens must be in \[0, 64\], got -1"),
    (lambda d, lengths: d.__setitem__((2, 0), lengths[2] + 1), r"draft_masks\[2\]\.tokens is \d+, past branch 2"),
])
def test_bad_draft_masks_are_refused(api, host_context, spoil, match):
    alloc, ids = seed_like_tree(torch.float16, 64, device="cpu")
    problem = allocator_problem(alloc, ids, 8)
    problem.lengths = np.minimum(problem.lengths, 60)  # short rows: a draft may be past one
    problem.drafts = np.zeros((len(ids), 2), np.int64)
    spoil(problem.drafts, problem.lengths)
    rc, msg, _ = api.plan(host_context, problem)
    assert rc == FR_INVALID_ARGUMENT and re.search(match, msg), msg


@pytest.mark.parametrize("seq_lens", [[3000, 40], [100] * 200])
def test_paged_decode_workspace_size_agrees_with_python(api, host_context, seq_lens):
    shape, max_blocks = SEED_SHAPE, -(-max(seq_lens) // 16)
    splits = runtime.host_context(ARCH, 132).paged_decode_launches(
        {**dict(SEED_SHAPE), "dtype": "float16", "sm_scale": 0.1}, len(seq_lens), max_blocks, True)[1]
    partial_out = len(seq_lens) * 32 * splits * 128 * 4
    expected = 0 if splits == 1 else -(-partial_out // 256) * 256 + len(seq_lens) * 32 * splits * 4
    size = api.ffi.new("size_t*")
    rc, msg = api.call("frPagedDecodeWorkspaceSize", host_context, api.ffi.new("frAttentionShape*", shape),
                       len(seq_lens), max_blocks, size)
    assert rc == FR_OK and size[0] == expected, msg
    rc, msg = api.call("frPagedDecodeWorkspaceSize", host_context,
                       api.ffi.new("frAttentionShape*", dict(shape, head_dim=96)), 2, 4, size)
    assert rc == FR_UNSUPPORTED and size[0] == expected


# ---------------------------------------------------------------- the driver (fresh interpreters)

CAPI_PRELUDE = """
from flash_reasoning import capi
from test_capi import SMALL_BRANCHES, CApi, entry, length, small_problem
api = CApi()
root = str(capi.artifact_root()).encode()
"""


def in_fresh_interpreter(body: str, libcuda) -> dict:
    """test_launcher's `isolated` with the library opened as `api` and the artifacts as `root`."""
    return isolated(CAPI_PRELUDE + textwrap.dedent(body), libcuda)


def test_context_without_driver(tmp_path):
    missing = tmp_path / "no" / "libcuda.so.1"
    out = in_fresh_interpreter("""
        box = api.out("frContext")
        out["first"] = api.call("frContextCreate", root, 0, box)
        out["again"] = api.call("frContextCreate", root, 0, box)
        out["untouched"] = api.untouched(box)
        out["negative"] = api.call("frContextCreate", root, -1, box)
    """, libcuda=missing)
    for key in ("first", "again"):  # a failed load is retried, and fails the same way
        status, message = out[key]
        assert status == FR_DRIVER_UNAVAILABLE and "could not load libcuda" in message, message
        assert f"FLASH_REASONING_LIBCUDA={missing}" in message and "NVIDIA driver" in message
    assert out["untouched"]
    assert out["negative"][0] == FR_INVALID_ARGUMENT and "device must be >= 0" in out["negative"][1]


def test_fake_driver_context_and_memory(tmp_path, fake_libcuda):
    wrong_arch = tmp_path / "wrong" / "sm90" / "manifest.json"  # the fake device is an sm90
    wrong_arch.parent.mkdir(parents=True)
    manifest = json.loads((capi.artifact_root() / ARCH / "manifest.json").read_text())
    wrong_arch.write_text(json.dumps(dict(manifest, arch="sm89")))
    out = in_fresh_interpreter(f"""
        box = api.out("frContext")
        wrong = api.out("frContext")
        out["wrong_arch"] = [*api.call("frContextCreate", {str(wrong_arch.parent.parent).encode()!r}, 0, wrong),
                             api.untouched(wrong)]
        out["create"] = api.call("frContextCreate", root, 0, box)
        context = box[0]
        arch = api.ffi.new("char**")
        api.lib.frContextArch(context, arch)
        out["arch"] = api.ffi.string(arch[0]).decode()
        bad = api.out("frContext")
        out["bad_device"] = [*api.call("frContextCreate", root, 3, bad), api.untouched(bad)]
        pointer = api.ffi.new("void**")
        out["alloc"] = api.call("frDeviceAlloc", context, 4096, pointer)
        sent, back = bytes(range(256)) * 16, api.ffi.new("char[4096]")
        out["to_device"] = api.call("frCopyToDevice", context, pointer[0], sent, 4096)
        out["to_host"] = api.call("frCopyToHost", context, back, pointer[0], 4096)
        out["round_trip"] = api.ffi.buffer(back)[:] == sent
        out["null_source"] = api.call("frCopyToDevice", context, pointer[0], api.ffi.NULL, 8)
        out["sync"] = api.call("frStreamSynchronize", context, api.ffi.NULL)
        out["free"] = api.call("frDeviceFree", context, pointer[0])
    """, libcuda=fake_libcuda)
    assert out.pop("create") == [FR_OK, ""] and out.pop("arch") == "sm90"
    status, message, untouched = out.pop("wrong_arch")
    assert status == FR_INVALID_MANIFEST and untouched, message
    assert str(wrong_arch) in message and "arch 'sm89'" in message and "folder 'sm90'" in message
    status, message, untouched = out.pop("bad_device")
    assert status == FR_CUDA_ERROR and "cuDeviceGet(3)" in message and "CUDA_ERROR_INVALID_DEVICE" in message
    assert untouched and out.pop("round_trip")
    assert out.pop("null_source")[0] == FR_INVALID_ARGUMENT
    assert all(result == [FR_OK, ""] for result in out.values()), out


def test_fake_driver_plan_update(fake_libcuda):
    out = in_fresh_interpreter("""
        box = api.out("frContext")
        api.lib.frContextCreate(root, 0, box)
        context = box[0]
        status, message, plan = api.plan(context, small_problem())
        out["create"] = [status, message, api.info(plan)]
        def update(spoil):
            problem = small_problem()
            problem.lengths += 1  # one decode step: column 5 takes the 81st token
            spoil(problem)
            return [*api.call("frPlanUpdate", plan, problem.tree_c(api), api.ffi.NULL), api.info(plan)]
        # Rejected first: each must leave the plan as created.
        out["shared_block"] = update(entry(1, 1, 900))
        out["branch_count"] = update(lambda p: setattr(p, "num_branches", 2))
        out["outgrown"] = update(length(0, 6 * 16 + 1))
        out["shrunk"] = update(length(2, 10))
        out["bad_entry"] = update(entry(0, 5, 4096))
        out["negative_count"] = update(lambda p: setattr(p, "num_branches", -1))
        out["negative_stride"] = update(lambda p: setattr(p, "stride", -1))
        out["negative_length"] = update(lambda p: (setattr(p, "num_branches", 2), length(1, -1)(p)))
        out["null_lengths"] = [*api.call("frPlanUpdate", plan, api.ffi.new("frTree*", dict(
            num_branches=SMALL_BRANCHES, table_stride=7)), api.ffi.NULL), api.info(plan)]
        out["own_block"] = update(entry(1, 4, 900))  # outside the root: a leaf may move (copy-on-write)
        out["leaves_grew"] = update(lambda p: None)
        p = api.pointer(256)
        out["misaligned"] = api.call("frPlanRun", plan, api.pointer(8), p, p, p, api.ffi.NULL)
        out["out_overlaps_q"] = api.call("frPlanRun", plan, p, p, p, api.pointer(256 + 16), api.ffi.NULL)
        out["append_negative"] = api.call("frAppendKV", context, p, p, p, p, p, -1, 8, 128, api.ffi.NULL)
        out["append_null"] = api.call("frAppendKV", context, p, p, api.ffi.NULL, p, p, 3, 8, 128, api.ffi.NULL)
        out["append_no_heads"] = api.call("frAppendKV", context, p, p, p, p, p, 3, 0, 128, api.ffi.NULL)
        out["append_negative_dim"] = api.call("frAppendKV", context, p, p, p, p, p, 3, 8, -1, api.ffi.NULL)
        shape = small_problem().shape_c(api)
        out["decode_negative"] = api.call("frPagedDecode", context, shape, p, p, p, p, p, -1, 4, p, api.ffi.NULL, 0,
                                          api.ffi.NULL)
        out["decode_no_columns"] = api.call("frPagedDecode", context, shape, p, p, p, p, p, 2, 0, p, api.ffi.NULL, 0,
                                            api.ffi.NULL)
        out["decode_null_out"] = api.call("frPagedDecode", context, shape, p, p, p, p, p, 2, 4, api.ffi.NULL,
                                          api.ffi.NULL, 0, api.ffi.NULL)
        out["decode_out_is_q"] = api.call("frPagedDecode", context, shape, p, p, p, p, p, 2, 4, p, api.ffi.NULL, 0,
                                          api.ffi.NULL)
    """, libcuda=fake_libcuda)
    status, message, created = out.pop("create")
    assert status == FR_OK, message
    assert created["max_blocks"] == 6 and created["logical_tokens"] == SMALL_BRANCHES * 80
    assert (created["computed_nodes"], created["num_launches"]) == (0, 1)
    rejected = {
        "shared_block": (FR_PLAN_MISMATCH, ["branch 1 changed block 1 (1 -> 900)", "create a new plan"]),
        "branch_count": (FR_PLAN_MISMATCH, [f"the plan has {SMALL_BRANCHES} branches, the tree 2"]),
        "outgrown": (FR_PLAN_MISMATCH, ["branch 0 needs 7 blocks, the plan holds 6", "extra_blocks"]),
        "shrunk": (FR_PLAN_MISMATCH, ["branch 2 shrank to 10 tokens"]),
        "bad_entry": (FR_INVALID_ARGUMENT, ["block_tables[0][5] is 4096"]),
        # Checked before the tree is compared with the plan: bad input, not a changed tree.
        "negative_count": (FR_INVALID_ARGUMENT, ["tree.num_branches must be >= 0, got -1"]),
        "negative_stride": (FR_INVALID_ARGUMENT, ["tree.table_stride must be >= 0, got -1"]),
        "negative_length": (FR_INVALID_ARGUMENT, ["tree.lengths[1] must be >= 0, got -1"]),
        "null_lengths": (FR_INVALID_ARGUMENT, ["tree.lengths and tree.block_tables must not be NULL"]),
    }
    for key, (status, fragments) in rejected.items():
        got, message, info = out[key]
        assert got == status and all(f in message for f in fragments), (key, message)
        assert info == created, key
    for key in ("own_block", "leaves_grew"):
        got, message, info = out[key]
        assert got == FR_OK and info == dict(created, logical_tokens=SMALL_BRANCHES * 81), (key, message, info)
    for key, fragment in [("misaligned", "q must be a non-NULL, 16-byte aligned"), ("append_negative", "num_tokens"),
                          ("append_null", "slots must be a non-NULL"), ("append_no_heads", "got 3, 0, 128"),
                          ("append_negative_dim", "got 3, 8, -1"), ("decode_negative", "num_seqs must be in [0, 2^31), got -1"),
                          ("decode_no_columns", "max_blocks must be in [1, 2^31), got 0"), ("decode_null_out", "out must be a non-NULL"),
                          ("out_overlaps_q", "out overlaps q"), ("decode_out_is_q", "out overlaps q")]:
        assert out[key][0] == FR_INVALID_ARGUMENT and fragment in out[key][1], (key, out[key])


def lane_problem() -> Problem:
    """256 branches of 272 tokens (a 256-token root, 16 own tokens), 4 queries each as the C ABI
    takes them (a row per query with its branch's table and causal length): at GQA group 4 they
    fill 64 query tiles of 4 lanes that share the root."""
    branches = shared_root(256, root=256, leaf=16)
    rows = np.repeat(np.arange(256), 4)
    lengths = branches.lengths[rows] - 3 + np.tile(np.arange(4), 256)
    return Problem(lengths.astype(np.int32), branches.tables[rows])


def test_fake_driver_lane_plan_update(fake_libcuda):
    """A plan of query tiles with lanes refuses an update where a lane stops holding the blocks
    the tile reads once for all lanes, or a lane's rows stop listing the same blocks; it takes
    the lanes' growth."""
    out = in_fresh_interpreter("""
        from test_capi import lane_problem, kernel_names
        box = api.out("frContext")
        api.lib.frContextCreate(root, 0, box)
        status, message, plan = api.plan(box[0], lane_problem())
        out["create"] = [status, message, kernel_names(api, plan)]
        def update(row, column):
            problem = lane_problem()
            problem.lengths += 1  # one token more: column 17, each branch's own
            problem.tables[row, column] = 4000
            return api.call("frPlanUpdate", plan, problem.tree_c(api), api.ffi.NULL)
        out["shared_block"] = update(4, 0)  # lane 2's first row: a root block
        out["lane_block"] = update(5, 16)   # lane 2's second row: an own block
        out["grew"] = update(0, 18)         # a column past every row's length
    """, libcuda=fake_libcuda)
    status, message, kernels = out["create"]
    assert status == FR_OK and "_lanes1_" in kernels[0], (message, kernels)
    assert out["shared_block"][0] == FR_PLAN_MISMATCH
    assert ("branch 4 no longer holds the blocks of branch 0 for its first 256 tokens, which its "
            "query tile reads once for both") in out["shared_block"][1]
    assert out["lane_block"][0] == FR_PLAN_MISMATCH
    assert "branch 5 no longer lists the blocks of branch 4" in out["lane_block"][1]
    assert out["grew"] == [FR_OK, ""]


def test_fake_driver_allocator_steps_keep_the_plan(fake_libcuda):
    """The allocator's decode steps are what frPlanUpdate accepts: leaves grow, new blocks."""
    out = in_fresh_interpreter("""
        import torch
        from test_capi import allocator_problem, decode_steps, seed_like_tree
        box = api.out("frContext")
        api.lib.frContextCreate(root, 0, box)
        alloc, ids = seed_like_tree(torch.float16, 128, device="cpu")
        status, message, plan = api.plan(box[0], allocator_problem(alloc, ids, 32))
        out["create"] = [status, message]
        out["steps"] = decode_steps(api, plan, alloc, ids, api.ffi.NULL)
        out["info"] = api.info(plan)
    """, libcuda=fake_libcuda)
    assert out["create"] == [FR_OK, ""]
    assert out["steps"] == [[FR_OK, ""]] * DECODE_STEPS
    assert out["info"]["logical_tokens"] == 48 * (1040 + DECODE_STEPS) and out["info"]["computed_nodes"] == 1


# ---------------------------------------------------------------- GPU: the cffi path against the Python API

@pytest.fixture(scope="module")
def gpu_context(api):
    box = api.out("frContext")
    rc, msg = api.call("frContextCreate", str(capi.artifact_root()).encode(), torch.cuda.current_device(), box)
    assert rc == FR_OK, msg
    yield box[0]
    api.lib.frContextDestroy(box[0])


def stream(api):
    return api.pointer(torch.cuda.current_stream().cuda_stream)


def fr_dtype(dtype: torch.dtype) -> int:
    return {torch.float16: FR_FLOAT16, torch.bfloat16: FR_BFLOAT16}[dtype]


def allocator_problem(alloc, ids, num_qo_heads: int) -> Problem:
    tables, lengths = alloc.block_tables(ids)
    return Problem(lengths.cpu().numpy(), tables.cpu().numpy(), extra=2, shape=dict(
        num_qo_heads=num_qo_heads, num_kv_heads=alloc.num_kv_heads, head_dim=alloc.head_dim,
        dtype=fr_dtype(alloc.dtype), block_size=alloc.block_size, num_blocks=alloc.num_blocks, sm_scale=0.0))


DECODE_STEPS = 9  # from 1040 tokens: the first step starts a block


def decode_steps(api, plan, alloc, ids, stream_handle) -> list:
    """DECODE_STEPS allocator decode steps (one new token per branch), each followed by
    frPlanUpdate; the (status, message) of each update."""
    from flash_reasoning.tools.synthetic import random_kv
    gen = torch.Generator().manual_seed(1)
    updates = []
    for _ in range(DECODE_STEPS):
        alloc.append(ids, 0, *random_kv(alloc, gen, len(ids)))
        problem = allocator_problem(alloc, ids, 32)  # owns the arrays the tree points at
        updates.append(api.call("frPlanUpdate", plan, problem.tree_c(api), stream_handle))
    return updates


def run_plan(api, plan, alloc, q) -> torch.Tensor:
    out = poisoned_like(q)
    p = api.pointer
    rc, msg = api.call("frPlanRun", plan, p(q.data_ptr()), p(alloc.k_pools[0].data_ptr()),
                       p(alloc.v_pools[0].data_ptr()), p(out.data_ptr()), stream(api))
    assert rc == FR_OK, msg
    return out


def assert_matches_python(out, q, alloc, ids):
    import flash_reasoning
    tolerance = reference.TOLERANCE[q.dtype]
    python = flash_reasoning.tree_attention(q, alloc, ids)
    assert reference.relative_error(out, python) < tolerance
    assert reference.relative_error(out, reference.tree_attention(q, alloc, ids)) < tolerance


def random_tree(dtype, head_dim):
    from flash_reasoning import PhysicalKVAllocator
    from flash_reasoning.tools.synthetic import random_branches
    alloc = PhysicalKVAllocator(64 * 16, 16, 4, head_dim, dtype=dtype, device="cuda")
    return alloc, random_branches(alloc, 40, 4, 300, seed=3)


def shared_root_tree(branches: int, prefix: int, leaf: int, dtype, head_dim: int, device: str,
                     block_size: int):
    """An allocator holding `branches` leaves of `leaf` tokens under a `prefix`-token root
    (8 KV heads), and the leaves' ids."""
    from flash_reasoning.tools.bench import case_allocator, seed_case
    case = seed_case(branches, prefix=prefix, leaf=leaf, num_kv_heads=8, head_dim=head_dim,
                     dtype=str(dtype).split(".")[-1])
    return case_allocator(case, device=device, block_size=block_size)


def seed_like_tree(dtype, head_dim, device="cuda", block_size=16):
    """48 leaves of 40 tokens under a 1000-token root (its last block is half full, so each
    leaf copies it on its first write): decode steps cross a block boundary at 1040."""
    return shared_root_tree(48, 1000, 40, dtype, head_dim, device, block_size)


def long_branches_tree(dtype, head_dim, device="cuda", block_size=16):
    """Two branches of 3000 tokens that share 2960: the planner merges separately."""
    return shared_root_tree(2, 2960, 40, dtype, head_dim, device, block_size)


def unshared_tree(dtype, head_dim, device="cuda", block_size=16):
    """200 branches of 300 tokens that share their first: nothing is worth computing once, so
    the plan is a paged decode (``PlanArrays.as_paged_decode``)."""
    return shared_root_tree(200, 1, 300, dtype, head_dim, device, block_size)


def packed_tree(dtype, head_dim, device="cuda", block_size=16):
    """256 leaves of 64 tokens under a 512-token root: on an H100 each final program serves
    four branches (the narrow tile)."""
    return shared_root_tree(256, 512, 64, dtype, head_dim, device, block_size)


def wide_packed_tree(dtype, head_dim, device="cuda", block_size=16):
    """256 leaves of 24 tokens under a 512-token root, which outlasts them: on an H100 each
    final program serves eight branches (the wide final tile)."""
    return shared_root_tree(256, 512, 24, dtype, head_dim, device, block_size)


def deep_tree(dtype, head_dim, device="cuda", block_size=16):
    """ft_deep16's tree: eight levels of 16-token nodes over 1024 leaves of 16 tokens. Its plan
    is flat, each final program reading the path its eight sibling leaves share once (the
    COMMON final kernel, in the wide tile)."""
    from flash_reasoning.tools.bench import case_allocator, load_cases
    case = next(c for c in load_cases()["cases"] if c["name"] == "ft_deep16/q32kv8")
    case = dict(case, head_dim=head_dim, dtype=str(dtype).split(".")[-1])
    return case_allocator(case, device=device, block_size=block_size)


def hosted_tree(dtype, head_dim, device="cuda", block_size=16):
    """ft_1,4,16,512/q32kv32's tree: each of its four level-1 nodes is two wide tiles of the
    1024-token root's rows, so the root's items read on through it (hosted), each item's range
    two runs of slots (the root's pages, then the child's: the two-run kernel)."""
    from flash_reasoning.tools.bench import case_allocator, load_cases
    case = next(c for c in load_cases()["cases"] if c["name"] == "ft_1,4,16,512/q32kv32")
    case = dict(case, head_dim=head_dim, dtype=str(dtype).split(".")[-1])
    return case_allocator(case, device=device, block_size=block_size)


def test_trees_take_the_final_kernels_they_are_meant_to():
    """What the GPU tests below rely on (H100, 132 SMs): a separate merge, one branch per
    final program, four, eight, a paged decode, eight with shared ranges."""
    from flash_reasoning import TreeAttentionPlan
    for make_tree, separate, lanes, decode, common in ((long_branches_tree, True, 1, False, False),
                                                       (seed_like_tree, False, 1, False, False),
                                                       (packed_tree, False, 4, False, False),
                                                       (wide_packed_tree, False, 8, False, False),
                                                       (unshared_tree, False, 1, True, False),
                                                       (deep_tree, False, 8, False, True)):
        alloc, ids = make_tree(torch.float16, 128, device="cpu")
        arrays = TreeAttentionPlan(alloc, ids, 32, _options=PlanOptions(num_sms=132)).arrays
        assert (arrays.separate_merge, arrays.final_lanes, arrays.as_paged_decode, arrays.has_common) == \
            (separate, lanes, decode, common)


@pytest.mark.parametrize("block_size, page", [(16, "_page16_"), (8, "_page0_")])
@pytest.mark.parametrize("make_tree, runs", [(long_branches_tree, 0), (seed_like_tree, 1),
                                             (packed_tree, 1), (wide_packed_tree, 1),
                                             (hosted_tree, 2), (unshared_tree, None),
                                             (deep_tree, None)])
def test_plan_kernels_agree_with_python(api, host_context, make_tree, runs, block_size, page):
    """The C ABI launches the kernels Python's dispatch picks, by name: a pool of 16-token
    blocks takes the kernels compiled for that page size, any other size the generic ones. The
    roots lie in consecutive pages: their partial launch reads them as one run of slots, except
    where it also holds the branches' open chunks (long_branches_tree merges separately), and
    as two where the root's items read on through its children (hosted_tree). A plan with no
    partials launches paged_decode's kernel alone (unshared_tree), or, where its final programs
    share ranges (deep_tree), the COMMON final kernel alone; eight lanes of group 4
    (wide_packed_tree, deep_tree) take the wide final tile's kernel."""
    from flash_reasoning import TreeAttentionPlan
    alloc, ids = make_tree(torch.float16, 128, device="cpu", block_size=block_size)
    rc, msg, plan = api.plan(host_context, allocator_problem(alloc, ids, 32))
    assert rc == FR_OK, msg
    python = TreeAttentionPlan(alloc, ids, 32, _options=PlanOptions(num_sms=132, arch=ARCH))
    q = torch.empty(len(ids), 32, 128, dtype=torch.float16)
    expected = [launch.spec.name for launch in python.launches(q, alloc.k_pools[0], alloc.v_pools[0], q)]
    names = kernel_names(api, plan)
    assert names == expected
    if make_tree is deep_tree:
        assert len(names) == 1 and names[0].startswith("tree_final") and "_common1_" in names[0]
    elif runs is None:
        assert len(names) == 1 and names[0].startswith("paged_decode")
    else:
        assert len(names) >= 2 and names[0].startswith("tree_partial")
        assert f"_slot_runs{runs}_" in names[0] and ("_page0_" in names[0] or not runs)
    paged = [name for name in names[bool(runs):] if not name.startswith("tree_merge")]
    assert paged and all(page in name for name in paged)
    assert ("_block_m32_" in names[-1]) == (make_tree in (wide_packed_tree, deep_tree))
    api.lib.frPlanDestroy(plan)


def kernel_names(api, plan) -> list:
    """frPlanKernelName of each of the plan's launches."""
    names = []
    for launch in range(api.info(plan)["num_launches"]):
        box = api.out("const char*")
        rc, msg = api.call("frPlanKernelName", plan, launch, box)
        assert rc == FR_OK, msg
        names.append(api.ffi.string(box[0]).decode())
    return names


@pytest.mark.parametrize("scatter, runs", [(None, 1), ("rotate", 2), ("swap", 0)])
def test_plan_reads_a_root_in_runs_of_consecutive_pages(api, host_context, scatter, runs):
    """A shared root whose pages follow one another takes the contiguous partial kernel; its
    pages rotated (one break, inside an item), the two-run kernel; two pages swapped (three
    breaks in one item), the paged one."""
    problem = shared_root(8, root=1024, leaf=8)
    if scatter == "rotate":
        problem.tables[:, :64] = np.roll(problem.tables[:, :64], -37, axis=1)
    elif scatter == "swap":
        problem.tables[:, [3, 4]] = problem.tables[:, [4, 3]]
    rc, msg, plan = api.plan(host_context, problem)
    assert rc == FR_OK, msg
    partial = [name for name in kernel_names(api, plan) if name.startswith("tree_partial")]
    assert partial and all(f"_slot_runs{runs}_" in name for name in partial)
    api.lib.frPlanDestroy(plan)


def test_plan_kernel_name_rejects(api, host_context):
    rc, msg, plan = api.plan(host_context, shared_root(4, root=64, leaf=8))
    assert rc == FR_OK, msg
    launches = api.info(plan)["num_launches"]
    for launch in (-1, launches):
        box = api.out("const char*")
        rc, msg = api.call("frPlanKernelName", plan, launch, box)
        assert rc == FR_INVALID_ARGUMENT and f"has {launches} launches" in msg and api.untouched(box)
    box = api.out("const char*")
    assert api.call("frPlanKernelName", api.ffi.NULL, 0, box)[0] == FR_INVALID_ARGUMENT
    assert api.call("frPlanKernelName", plan, 0, api.ffi.NULL)[0] == FR_INVALID_ARGUMENT
    api.lib.frPlanDestroy(plan)


def test_wide_token_rows_order_the_packed_final_launch():
    """What the GPU test below relies on (H100, 132 SMs): at head_dim 256 (4 KB token rows over
    8 KV heads) the packed trees' final launches run each program's heads together, at 128 not."""
    from flash_reasoning import TreeAttentionPlan
    for make_tree in (packed_tree, wide_packed_tree):
        for head_dim, heads_first in ((256, True), (128, False)):
            alloc, ids = make_tree(torch.float16, head_dim, device="cpu")
            arrays = TreeAttentionPlan(alloc, ids, 32, _options=PlanOptions(num_sms=132)).arrays
            assert arrays.final_heads_first == heads_first, (make_tree.__name__, head_dim)


@gpu
@pytest.mark.parametrize("make_tree", [random_tree, seed_like_tree, long_branches_tree, packed_tree,
                                       wide_packed_tree, unshared_tree, deep_tree, hosted_tree])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 128), (torch.bfloat16, 64),
                                             (torch.float16, 256)])  # 256: 4 KB rows, heads first
def test_gpu_plan_run_matches_python_api(api, gpu_context, make_tree, dtype, head_dim):
    torch.manual_seed(0)
    alloc, ids = make_tree(dtype, head_dim)
    num_qo_heads = 4 * alloc.num_kv_heads
    rc, msg, plan = api.plan(gpu_context, allocator_problem(alloc, ids, num_qo_heads))
    assert rc == FR_OK, msg
    q = torch.randn(len(ids), num_qo_heads, head_dim, device="cuda").to(dtype)
    assert_matches_python(run_plan(api, plan, alloc, q), q, alloc, ids)
    api.lib.frPlanDestroy(plan)


@gpu
@pytest.mark.parametrize("queries, kernel", [(lambda i: (i * 5) % 25, "tree_final"),
                                             (lambda i: 12 + i % 5, "tree_queries")])
def test_gpu_query_rows_match_the_reference(api, gpu_context, queries, kernel):
    """Query rows as a tree plan, and as query tiles (consecutive rows listing the same
    blocks: a branch's queries)."""
    from flash_reasoning.tools.synthetic import random_kv
    alloc, ids = seed_like_tree(torch.float16, 128)
    alloc.append(alloc.reserve(ids, 8), 0,  # a block each: the pool's spare
                 *random_kv(alloc, torch.Generator().manual_seed(2), 8 * len(ids)))
    q_lens = [queries(i) for i in range(len(ids))]
    rc, msg, plan = api.plan(gpu_context, query_row_problem(alloc, ids, q_lens, 32))
    assert rc == FR_OK, msg
    assert kernel_names(api, plan)[-1].startswith(kernel)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").half()
    out = run_plan(api, plan, alloc, q)
    expected = reference.tree_attention(q, alloc, ids, q_lens=q_lens)
    assert reference.relative_error(out, expected) < reference.TOLERANCE[q.dtype]
    api.lib.frPlanDestroy(plan)


@gpu
def test_gpu_draft_rows_match_the_reference(api, gpu_context):
    from test_tree_attention import random_masks

    from flash_reasoning.tools.synthetic import random_kv
    alloc, ids = seed_like_tree(torch.float16, 128)
    alloc.append(alloc.reserve(ids, 8), 0,  # a block each: the pool's spare
                 *random_kv(alloc, torch.Generator().manual_seed(3), 8 * len(ids)))
    q_lens = [(i * 5) % 25 for i in range(len(ids))]
    mask = random_masks(q_lens, 4)
    rc, msg, plan = api.plan(gpu_context, draft_row_problem(alloc, ids, q_lens, mask, 32))
    assert rc == FR_OK, msg
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").half()
    out = run_plan(api, plan, alloc, q)
    expected = reference.tree_attention(q, alloc, ids, q_lens=q_lens, mask=mask)
    assert reference.relative_error(out, expected) < reference.TOLERANCE[q.dtype]
    api.lib.frPlanDestroy(plan)


@gpu
@pytest.mark.parametrize("make_tree, length", [(seed_like_tree, 1040), (long_branches_tree, 3000),
                                               (packed_tree, 576), (wide_packed_tree, 536),
                                               (unshared_tree, 301), (deep_tree, 144)])
def test_gpu_plan_update_after_append(api, gpu_context, make_tree, length):
    alloc, ids = make_tree(torch.float16, 128)
    rc, msg, plan = api.plan(gpu_context, allocator_problem(alloc, ids, 32))
    assert rc == FR_OK, msg
    assert decode_steps(api, plan, alloc, ids, stream(api)) == [(FR_OK, "")] * DECODE_STEPS
    assert api.info(plan)["logical_tokens"] == len(ids) * (length + DECODE_STEPS)
    torch.manual_seed(0)
    q = torch.randn(len(ids), 32, 128, device="cuda").half()
    assert_matches_python(run_plan(api, plan, alloc, q), q, alloc, ids)
    api.lib.frPlanDestroy(plan)


@gpu
@pytest.mark.parametrize("seq_lens", [[3000, 40], [100] * 200])
@pytest.mark.parametrize("with_workspace", [True, False])
def test_gpu_paged_decode_matches_python_api(api, gpu_context, seq_lens, with_workspace):
    import flash_reasoning
    from flash_reasoning.tools.synthetic import paged_problem
    problem = paged_problem(seq_lens, 32, 8, 128, device="cuda", seed=5)
    shape = api.ffi.new("frAttentionShape*", dict(SEED_SHAPE, num_blocks=problem.k_pool.shape[0]))
    num_seqs, max_blocks = problem.block_tables.shape
    size = api.ffi.new("size_t*")
    assert api.call("frPagedDecodeWorkspaceSize", gpu_context, shape, num_seqs, max_blocks, size)[0] == FR_OK
    workspace = torch.empty(max(size[0], 16) if with_workspace else 0, dtype=torch.uint8, device="cuda")
    out = poisoned_like(problem.q)
    p = api.pointer
    rc, msg = api.call("frPagedDecode", gpu_context, shape, p(problem.q.data_ptr()), p(problem.k_pool.data_ptr()),
                       p(problem.v_pool.data_ptr()), p(problem.block_tables.data_ptr()),
                       p(problem.seq_lens.data_ptr()), num_seqs, max_blocks, p(out.data_ptr()),
                       p(workspace.data_ptr()) if with_workspace else api.ffi.NULL, workspace.numel(), stream(api))
    assert rc == FR_OK, msg
    python = flash_reasoning.paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                                          problem.seq_lens)
    expected = reference.paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                                      problem.seq_lens)
    assert reference.relative_error(out, python) < reference.TOLERANCE[torch.float16]
    assert reference.relative_error(out, expected) < reference.TOLERANCE[torch.float16]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_append_kv_matches_write_slots(api, gpu_context, dtype):
    from flash_reasoning import kv_cache
    gen = torch.Generator(device="cuda").manual_seed(7)
    pools = [torch.randn(64, 16, 8, 128, generator=gen, device="cuda").to(dtype) for _ in range(2)]
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:300]
    k, v = (torch.randn(300, 8, 128, generator=gen, device="cuda").to(dtype) for _ in range(2))
    expected = [pool.clone() for pool in pools]
    kv_cache.write_slots(*expected, slots, k, v)
    p = api.pointer
    rc, msg = api.call("frAppendKV", gpu_context, p(pools[0].data_ptr()), p(pools[1].data_ptr()),
                       p(slots.data_ptr()), p(k.data_ptr()), p(v.data_ptr()), 300, 8, 128, stream(api))
    assert rc == FR_OK, msg
    assert all(torch.equal(got, want) for got, want in zip(pools, expected))
