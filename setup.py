"""Builds the C++ core twice, as the pybind11 module and as the C library
(``libflash_reasoning.so`` with its header, for C/C++ runtimes), and the AOT cubins
(``aot/build.py``).

FLASH_REASONING_ARCHS=sm90 narrows the archs compiled (default: sm80, sm89, sm90);
FLASH_REASONING_AOT_JOBS sets the compile parallelism (default: all cores).
"""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
#: The C++ core by layer (docs/architecture.md): util, runtime, planner, ops.
CORE_SOURCES = sorted(src for layer in ("util", "runtime", "planner", "ops")
                      for src in glob(f"csrc/{layer}/*.cc"))
#: The C library exports only its fr* functions and needs only libc and libstdc++ (libcuda is
#: opened at run time): csrc/CMakeLists.txt builds it with the same flags.
C_LIBRARY_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-fno-math-errno", "-fvisibility=hidden",
                   "-fvisibility-inlines-hidden", "-Icsrc", "-Icsrc/include"]
C_LIBRARY_LINK = ["-shared", "-Wl,-soname,libflash_reasoning.so", "-static-libgcc",
                  "-Wl,--as-needed", "-Wl,--no-undefined",
                  "-Wl,--version-script=csrc/capi/exports.map"]


class BuildWithKernels(build_ext):
    """build_ext that also compiles the kernels into the package's ``_artifacts`` folder."""

    def run(self):
        super().run()
        target = ROOT / "python" if self.inplace or self.editable_mode else Path(self.build_lib)
        self._build_c_library(target / "flash_reasoning")
        self._build_kernels(target / "flash_reasoning" / "_artifacts")

    def _build_c_library(self, package: Path) -> None:
        """lib/libflash_reasoning.so and include/flash_reasoning/flash_reasoning.h."""
        cxx = os.environ.get("CXX", "g++")
        objects_dir = Path(self.build_temp) / "capi"
        objects_dir.mkdir(parents=True, exist_ok=True)
        sources = CORE_SOURCES + ["csrc/capi/flash_reasoning.cc"]
        objects = [str(objects_dir / (Path(s).stem + ".o")) for s in sources]
        compile_one = lambda src, obj: subprocess.run(  # noqa: E731
            [cxx, *C_LIBRARY_FLAGS, "-c", src, "-o", obj], cwd=ROOT, check=True)
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, sources, objects))
        (package / "lib").mkdir(parents=True, exist_ok=True)
        subprocess.run([cxx, *objects, *C_LIBRARY_LINK, "-o",
                        str(package / "lib" / "libflash_reasoning.so")], cwd=ROOT, check=True)
        header_dir = package / "include" / "flash_reasoning"
        header_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "csrc/include/flash_reasoning/flash_reasoning.h", header_dir)

    def _build_kernels(self, out_dir: Path) -> None:
        with checkout_on_path():
            from aot import build
            jobs = int(os.environ.get("FLASH_REASONING_AOT_JOBS", os.cpu_count() or 1))
            build.build(out_dir, build.archs_from_env(), jobs)


@contextmanager
def checkout_on_path():
    """aot/ (the build side, never installed) and the package importable from the checkout."""
    sys.path[:0] = [str(ROOT), str(ROOT / "python")]
    try:
        yield
    finally:
        del sys.path[:2]


def make_built_folders() -> None:
    """Makes the folders the build fills (ignored by git) before setuptools lists the packages,
    so that it lists them whether or not a build ran before: it warns of data files in a folder
    that is not a listed package."""
    with checkout_on_path():
        from aot.grid import ARCHS  # light: neither torch nor triton
    package = ROOT / "python" / "flash_reasoning"
    for folder in [*(f"_artifacts/{arch}" for arch in ARCHS), "lib", "include/flash_reasoning"]:
        (package / folder).mkdir(parents=True, exist_ok=True)


launcher = Pybind11Extension(
    "flash_reasoning._core",
    CORE_SOURCES + ["csrc/python/core_module.cc"],
    include_dirs=["csrc"],
    extra_link_args=["-ldl"],
    cxx_std=17,
)

make_built_folders()
setup(
    package_dir={"": "python"},
    # Namespace packages: the folders of data files (_artifacts/<arch>, data, tuning, lib,
    # include) are packages too, as setuptools asks of every folder that ships files.
    packages=find_namespace_packages("python", include=["flash_reasoning*"],
                                     exclude=["*.__pycache__"]),
    package_data={"flash_reasoning": ["_artifacts/*/*", "data/*.json", "tuning/*.json",
                                      "lib/*.so", "include/flash_reasoning/*.h"]},
    ext_modules=[launcher],
    cmdclass={"build_ext": BuildWithKernels},
    zip_safe=False,
)
