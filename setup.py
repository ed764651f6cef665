"""Builds the C++ launcher (pybind11 module) and the AOT cubins (``aot/build.py``).

FLASH_REASONING_ARCHS=sm90 narrows the archs compiled (default: sm80, sm89, sm90);
FLASH_REASONING_AOT_JOBS sets the compile parallelism (default: all cores).
"""
import os
import sys
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent


class BuildWithKernels(build_ext):
    """build_ext that also compiles the kernels into the package's ``_artifacts`` folder."""

    def run(self):
        super().run()
        target = ROOT / "python" if self.inplace or self.editable_mode else Path(self.build_lib)
        self._build_kernels(target / "flash_reasoning" / "_artifacts")

    def _build_kernels(self, out_dir: Path) -> None:
        sys.path[:0] = [str(ROOT), str(ROOT / "python")]
        try:
            from aot import build
            jobs = int(os.environ.get("FLASH_REASONING_AOT_JOBS", os.cpu_count() or 1))
            build.build(out_dir, build.archs_from_env(), jobs)
        finally:
            del sys.path[:2]


launcher = Pybind11Extension(
    "flash_reasoning._launcher",
    sorted(glob("csrc/core/*.cc")) + ["csrc/python/module.cc"],
    include_dirs=["csrc/core"],
    extra_link_args=["-ldl"],
    cxx_std=17,
)

setup(
    package_dir={"": "python"},
    packages=["flash_reasoning", "flash_reasoning.ops"],
    package_data={"flash_reasoning": ["_artifacts/*/*", "data/*.json"]},
    ext_modules=[launcher],
    cmdclass={"build_ext": BuildWithKernels},
    zip_safe=False,
)
