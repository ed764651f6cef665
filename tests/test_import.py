"""Run time never imports triton: import and run with triton made unimportable."""
import subprocess
import sys
import textwrap

from conftest import HAS_GPU

BLOCK_TRITON = textwrap.dedent("""
    import sys
    class BlockTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("triton is blocked in this test")
    sys.meta_path.insert(0, BlockTriton())
""")

RUN = textwrap.dedent("""
    import flash_reasoning, torch
    from flash_reasoning.synthetic import paged_problem
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
