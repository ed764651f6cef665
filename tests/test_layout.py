"""The layers of docs/architecture.md, as the sources state them: each C++ layer includes only
the layers below it, and the library never imports its tools or the build side."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PACKAGE = ROOT / "python" / "flash_reasoning"

#: What each C++ layer may include (besides itself): the layers below it.
CSRC_LAYERS = {
    "util": set(),
    "runtime": {"util"},
    "planner": {"util"},
    "ops": {"util", "runtime", "planner"},
    "capi": {"util", "runtime", "planner", "ops", "flash_reasoning"},
    "python": {"util", "runtime", "planner", "ops"},
}


def csrc_includes(path: Path) -> set[str]:
    """The layers (first path component) of a C++ file's project includes."""
    text = path.read_text()
    return {include.split("/")[0] for include in re.findall(r'#include "([^"]+)"', text)}


@pytest.mark.parametrize("layer", sorted(CSRC_LAYERS))
def test_each_csrc_layer_includes_only_the_layers_below(layer):
    files = sorted((CSRC / layer).glob("*.[ch]*"))
    assert files, f"csrc/{layer} is empty"
    for path in files:
        wrong = csrc_includes(path) - CSRC_LAYERS[layer] - {layer}
        assert not wrong, f"{path.relative_to(ROOT)} includes {sorted(wrong)}"


def test_every_csrc_source_lives_in_a_layer():
    folders = {p.name for p in CSRC.iterdir() if p.is_dir()}
    assert folders == set(CSRC_LAYERS) | {"include"}


def imported_modules(path: Path) -> set[str]:
    """The flash_reasoning modules (and top-level packages) a Python file imports, resolved."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *(node.module.split(".") if node.module else ())))
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


LIBRARY = [p for p in PACKAGE.rglob("*.py") if "tools" not in p.relative_to(PACKAGE).parts
           and "hf" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_imports_neither_its_tools_nor_the_build(path):
    """Run time never imports triton or aot/ (the build side), and the library never its
    tools (cli, bench, tune, ...): they import it."""
    modules = imported_modules(path)
    wrong = {m for m in modules if m.split(".")[0] in ("triton", "aot", "transformers")
             or m.startswith("flash_reasoning.tools")}
    assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"
