"""Run time never imports triton: import and run with triton made unimportable."""
import subprocess
import sys
import textwrap

from conftest import HAS_GPU

# find_spec must still succeed (torch's CUDA init asks whether triton exists); importing it
# must fail.
BLOCK_TRITON = textwrap.dedent("""
    import importlib.abc, importlib.machinery, sys
    class Refuse(importlib.abc.Loader):
        def create_module(self, spec):
            raise ImportError("triton is blocked in this test")
        def exec_module(self, module):
            pass
    class BlockTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                return importlib.machinery.ModuleSpec(name, Refuse())
    sys.meta_path.insert(0, BlockTriton())
    try:
        import triton
        raise SystemExit("the block failed")
    except ImportError:
        pass
""")

RUN = textwrap.dedent("""
    import flash_reasoning, torch
    from flash_reasoning.tools.synthetic import paged_problem
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = paged_problem([40, 7], 8, 2, head_dim=128, device=device)
    out = flash_reasoning.paged_decode(p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    assert torch.isfinite(out).all()
    assert not any(m.startswith("triton") for m in sys.modules), "triton was imported"
    print("ran on", device)
""")


def test_import_and_decode_without_triton():
    env_free = {"TRITON_INTERPRET": ""}
    result = subprocess.run([sys.executable, "-c", BLOCK_TRITON + RUN], capture_output=True,
                            text=True, env={**__import__("os").environ, **env_free})
    assert result.returncode == 0, result.stderr
    assert ("ran on cuda" if HAS_GPU else "ran on cpu") in result.stdout
