"""Compile every specialization of the grid to cubins, one folder and manifest per arch.

Runs with no GPU: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``.
Incremental (each cubin is cached under a hash of its kernel source and specialization)
and parallel. ``python -m aot.build --out DIR [--archs sm90] [--jobs N]``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import inspect
import json
import multiprocessing
import os
import re
import sys
from pathlib import Path

from flash_reasoning import __version__, dispatch
from flash_reasoning.specializations import FAMILIES, SCRATCH_PARAMS, Spec

from . import grid

MANIFEST_FORMAT = 1
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / "build" / "aot-cache"


def _kernel_source(family: str) -> str:
    """The kernel's module plus what every kernel shares (the inlined core, the item layout):
    a change to any of them must recompile."""
    from flash_reasoning import specializations

    from .kernels import JIT_FUNCTIONS, attention_core
    modules = (sys.modules[JIT_FUNCTIONS[family].fn.__module__], attention_core, specializations)
    return "".join(inspect.getsource(m) for m in modules)


def cache_key(arch: str, spec: Spec) -> str:
    import triton
    payload = json.dumps({"source": _kernel_source(spec.family), "signature": spec.signature(),
                          "key": spec.key, "arch": arch, "triton": triton.__version__},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def compile_spec(arch: str, spec: Spec) -> tuple[bytes, dict]:
    """Compile one specialization; returns the cubin and its manifest entry (sans sha)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .kernels import JIT_FUNCTIONS
    fn = JIT_FUNCTIONS[spec.family]
    family = FAMILIES[spec.family]
    declared = family.param_names + family.constexprs
    if tuple(fn.arg_names) != declared:
        raise RuntimeError(f"kernel {spec.family} takes {tuple(fn.arg_names)} but "
                           f"specializations.py declares {declared}")
    signature = spec.signature()
    # Every pointer is 16-byte aligned (checked at launch), so loads can be vectorised.
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, name in enumerate(family.param_names) if signature[name].startswith("*")}
    source = ASTSource(fn, signature, constexprs=dict(spec.constexprs), attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", int(arch[2:]), 32),
                              options={"num_warps": spec.num_warps,
                                       "num_stages": spec.num_stages})
    meta = compiled.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"{spec.name} ({arch}) needs scratch memory "
                           f"({meta.global_scratch_size}/{meta.profile_scratch_size} B): "
                           "the launcher passes none")
    if spec.overlaps_previous and "griddepcontrol.wait" not in compiled.asm["ptx"]:
        raise RuntimeError(f"{spec.name} ({arch}) is launched to overlap the launch before it but "
                           "never waits for it (no griddepcontrol.wait in its PTX)")
    if meta.shared > grid.MAX_SHARED[arch]:
        raise RuntimeError(f"{spec.name} needs {meta.shared} B of shared memory; {arch} "
                           f"allows {grid.MAX_SHARED[arch]} B: give it fewer stages there")
    params = [{"name": n, "type": t} for n, t in spec.runtime_params()]
    _describe_tensor_maps(spec, params, getattr(meta, "tensordesc_meta", None))
    params += [{"name": n, "type": t} for n, t in SCRATCH_PARAMS]
    entry = {"name": spec.name, "kernel": spec.family, "entry": compiled.name,
             "cubin": f"{spec.name}.cubin", "key": spec.key, "params": params,
             "num_warps": meta.num_warps, "num_stages": spec.num_stages,
             "shared": meta.shared}
    return compiled.asm["cubin"], entry


#: CUtensorMapDataType (cuda.h) of the element types Triton's descriptor metadata names (its
#: own numbering): fp16 and bf16, the pools' dtypes.
_TENSOR_MAP_DATA_TYPES = {6: 6, 10: 9}


def _describe_tensor_maps(spec: Spec, params: list[dict], described: list | None) -> None:
    """Adds to each ``nvTmaDesc`` param of ``params`` what the launcher encodes its descriptor
    with (cuTensorMapEncodeTiled's data type, swizzle and box, the box in the view's order:
    rows, columns), from the compiled kernel's descriptor metadata; fails where the kernel did
    not lower its descriptors to TMA (Triton then expects other parameters)."""
    maps = [p for p in params if p["type"] == "nvTmaDesc"]
    described = described or []
    if len(maps) != len(described) or None in described:
        raise RuntimeError(f"{spec.name}: Triton describes descriptors {described} for the "
                           f"tensor maps {[p['name'] for p in maps]}: they were not lowered to TMA")
    for param, desc in zip(maps, described):
        if desc["elem_type"] not in _TENSOR_MAP_DATA_TYPES or desc["fp4_padded"]:
            raise RuntimeError(f"{spec.name}: tensor map {param['name']} has element type "
                               f"{desc['elem_type']}, which the launcher does not encode")
        param["tensor_map"] = {"data_type": _TENSOR_MAP_DATA_TYPES[desc["elem_type"]],
                               "elem_size": desc["elem_size"], "swizzle": desc["swizzle"],
                               "box": list(desc["block_size"])}


def _compile_cached(arch: str, spec: Spec, cache_dir: Path) -> tuple[dict, bool]:
    """The manifest entry of ``spec`` (cubin in the cache) and whether it was compiled now."""
    key = cache_key(arch, spec)
    cubin_path, entry_path = cache_dir / f"{key}.cubin", cache_dir / f"{key}.json"
    compiled = not (cubin_path.exists() and entry_path.exists())
    if compiled:
        cubin, entry = compile_spec(arch, spec)
        entry["source_hash"] = key
        cache_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(cubin_path, cubin)
        _atomic_write(entry_path, json.dumps(entry).encode())
    # Not the compile's output, so never stale in the cache: how to launch it, where it is.
    launch = {"overlaps_previous": spec.overlaps_previous, "_cached_cubin": str(cubin_path)}
    return json.loads(entry_path.read_text()) | launch, compiled


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _ptxas_version() -> str:
    from triton.backends.nvidia.compiler import get_ptxas_version
    found = re.search(r"release (\S+),", get_ptxas_version())
    return found.group(1) if found else "unknown"


def build(out_dir: Path, archs: list[str], jobs: int, cache_dir: Path = DEFAULT_CACHE) -> None:
    import triton
    tasks = [(arch, spec) for arch in archs for spec in grid.specs_for(arch)]
    with cf.ProcessPoolExecutor(max_workers=jobs,
                                mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_compile_cached, *zip(*tasks), [cache_dir] * len(tasks)))
    entries = [entry for entry, _ in results]
    fresh = sum(compiled for _, compiled in results)
    print(f"aot: compiled {fresh}, reused {len(tasks) - fresh} from {cache_dir}", flush=True)
    for arch in archs:
        arch_dir = out_dir / arch
        arch_dir.mkdir(parents=True, exist_ok=True)
        for stale in arch_dir.glob("*.cubin"):
            stale.unlink()
        kernels = []
        for (task_arch, _), entry in zip(tasks, entries):
            if task_arch == arch:
                cubin = Path(entry.pop("_cached_cubin")).read_bytes()
                (arch_dir / entry["cubin"]).write_bytes(cubin)
                kernels.append(entry | {"sha256": hashlib.sha256(cubin).hexdigest()})
        manifest = {"format": MANIFEST_FORMAT, "arch": arch, "package_version": __version__,
                    "triton_version": triton.__version__, "ptxas_version": _ptxas_version(),
                    "kernels": kernels, "dispatch": dispatch.dispatch_rules(arch)}
        (arch_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        print(f"aot: {arch}: {len(kernels)} kernels -> {arch_dir}", flush=True)


def archs_from_env() -> list[str]:
    """FLASH_REASONING_ARCHS="sm90" (comma-separated) narrows the build; default: all."""
    wanted = [a.strip() for a in os.environ.get("FLASH_REASONING_ARCHS", "").split(",")
              if a.strip()]
    unknown = sorted(set(wanted) - set(grid.ARCHS))
    if unknown:
        raise SystemExit(f"FLASH_REASONING_ARCHS names unknown archs {unknown}; "
                         f"choose from {grid.ARCHS}")
    return wanted or list(grid.ARCHS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", default=None, help="comma-separated, e.g. sm80,sm90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if args.archs:
        os.environ["FLASH_REASONING_ARCHS"] = args.archs
    build(args.out, archs_from_env(), args.jobs, args.cache)


if __name__ == "__main__":
    main()
