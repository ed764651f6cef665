"""Where the C ABI lives in an installed package, for C/C++ builds and cffi.

``libflash_reasoning.so`` and ``flash_reasoning.h`` are built by the package build next to
this module (``lib/`` and ``include/``); a C++ runtime compiles against :func:`include_dir`,
links :func:`library_path` and passes :func:`artifact_root` to ``frContextCreate``.
``python -m flash_reasoning.capi`` prints the three, e.g. for CMake.
"""
from __future__ import annotations

import re
from pathlib import Path

from . import runtime

_PACKAGE = Path(__file__).resolve().parent
#: The lines that open and close the header's ``extern "C"`` block, however they are spaced.
_EXTERN_C_BRACE = re.compile(r'extern\s+"C"\s*\{|\}\s*/\*\s*extern\s+"C"\s*\*/')


def library_path() -> Path:
    return _require(_PACKAGE / "lib" / "libflash_reasoning.so")


def include_dir() -> Path:
    """The folder to add to the include path: ``#include <flash_reasoning/flash_reasoning.h>``."""
    return _require(_PACKAGE / "include" / "flash_reasoning" / "flash_reasoning.h").parent.parent


def header_path() -> Path:
    return include_dir() / "flash_reasoning" / "flash_reasoning.h"


def artifact_root() -> Path:
    """The folder of per-arch cubins and manifests ``frContextCreate`` takes."""
    return runtime.artifact_root()


def cdef_text() -> str:
    """The header's declarations as cffi's ``ffi.cdef`` takes them: preprocessor lines and
    the ``extern "C"`` braces dropped (the header keeps its declarations free of macros)."""
    lines = header_path().read_text().splitlines()
    kept = [ln for ln in lines if not ln.lstrip().startswith("#")
            and not _EXTERN_C_BRACE.fullmatch(ln.strip())]
    return "\n".join(kept)



def _require(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the C library is built by the package build "
                                "(pip install .), or alone with cmake -S csrc")
    return path


if __name__ == "__main__":
    print(f"library:   {library_path()}\ninclude:   {include_dir()}\nartifacts: {artifact_root()}")
