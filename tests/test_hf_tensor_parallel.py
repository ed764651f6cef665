"""flash_reasoning.hf under transformers' tensor parallelism (``tp_plan="auto"``): each rank's
cache holds its share of the KV heads and every rank applies the same tree operations. Two CPU
ranks over gloo: the greedy continuations and their logits equal transformers' on one
process, and beam search gives the one-process beams. One and two GPU ranks over NCCL
(bfloat16, decode steps in CUDA graphs): the logits along one GPU's greedy tokens within
bfloat16's tolerance of one GPU's, the same tokens."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a tp_plan through it

import hf_tensor_parallel_worker as worker  # noqa: E402
from conftest import free_port, gpu  # noqa: E402
from flash_reasoning.hf import beam_search, sample  # noqa: E402
from flash_reasoning.hf.models import random_model, twin  # noqa: E402
from hf_decoding import HALF_TOLERANCE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
#: (arch, query heads, KV heads, head_dim): 4/2 heads a rank (group 2) and, with q/k/v
#: biases, 14/2 (group 7).
SHAPES = [("llama", 8, 4, 64), ("qwen2", 28, 4, 128)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each shape's model saved, then decoded by WORLD ranks: (model, rank results) each."""
    root = tmp_path_factory.mktemp("tp")
    models, dirs = [], []
    for i, shape in enumerate(SHAPES):
        model = random_model(*shape, seed=i)
        model.save_pretrained(root / f"model{i}")
        models.append(model)
        dirs.append(str(root / f"model{i}"))
    run_ranks(WORLD, "cpu", root / "out", *dirs)
    ranks = [torch.load(f"{root / 'out'}.rank{r}", weights_only=False) for r in range(WORLD)]
    return [(model, [rank[i] for rank in ranks]) for i, model in enumerate(models)]


@pytest.mark.parametrize("index", range(len(SHAPES)),
                         ids=[f"{a}-q{q}kv{kv}-d{d}" for a, q, kv, d in SHAPES])
def test_each_rank_holds_its_heads_and_decodes_as_one_process(runs, index):
    model, ranks = runs[index]
    _, heads, kv_heads, _ = SHAPES[index]
    ref = twin(model)
    prompt = torch.tensor(worker.PROMPT)
    rows = torch.cat([prompt.expand(len(worker.FIRST_TOKENS), -1),
                      torch.tensor(worker.FIRST_TOKENS)[:, None]], dim=1)
    out = ref.generate(rows, do_sample=False, max_new_tokens=worker.STEPS - 1,
                       min_new_tokens=worker.STEPS - 1, output_logits=True,
                       return_dict_in_generate=True)
    theirs, logits = out.sequences[:, rows.shape[1]:], torch.stack(out.logits, dim=1)
    beams = beam_search(model, prompt, worker.BEAMS, worker.STEPS, cuda_graphs=False)
    for rank in ranks:
        assert rank["heads"] == (heads // WORLD, kv_heads // WORLD)
        assert torch.equal(rank["tokens"][:, 1:], theirs)
        # The ranks' all-reduces sum the heads' shares in another order than one matmul.
        torch.testing.assert_close(rank["logits"][:, 1:], logits, rtol=0,
                                   atol=1e-4 * logits.abs().max())
        assert torch.equal(rank["beam_sequences"], beams.sequences)
        torch.testing.assert_close(rank["beam_scores"], beams.scores, rtol=1e-4, atol=1e-5)


def run_ranks(world: int, device: str, out, *args) -> None:
    """``hf_tensor_parallel_worker.py device out args...`` on ``world`` ranks (torchrun)."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
         f"--master_port={free_port()}", str(here / "hf_tensor_parallel_worker.py"), device,
         str(out), *map(str, args)], env=env, capture_output=True, text=True, timeout=600)
    # The ranks' own output (a traceback, or a C++ abort's reason), then torchrun's report.
    assert done.returncode == 0, done.stderr[-10000:]


BF16_TOLERANCE = HALF_TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.parametrize("world", [
    1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                reason="needs two CUDA GPUs"))])
def test_gpu_ranks_decode_as_one_gpu(tmp_path, world):
    """Llama-3-8B's attention shape, 2 layers: one GPU's greedy sampling (CUDA graphs), then
    ``world`` ranks' sampling and their logits along one GPU's tokens (one rank: the whole
    model on its GPU through the same loading, NCCL and graphs)."""
    model = random_model("llama", 32, 8, 128, num_layers=2, hidden_size=4096,
                         intermediate_size=14336, vocab_size=32000, dtype=torch.bfloat16,
                         device="cuda", init_std=0.02)
    prompt = torch.randint(0, 32000, (300,), generator=torch.Generator().manual_seed(3))
    first = [5, 17, 99, 1234]
    one = sample(model, prompt.cuda(), len(first), 32, first_tokens=first, return_logits=True)
    ones_logits = one.logits[:, 1:].float().cpu()  # after each forced token
    ones_tokens = one.tokens.cpu()
    model.save_pretrained(tmp_path / "model")
    del model, one
    torch.cuda.empty_cache()
    torch.save({"prompt": prompt, "first": first, "forced": ones_tokens}, tmp_path / "forced.pt")
    run_ranks(world, "cuda", tmp_path / "out", tmp_path / "forced.pt", tmp_path / "model")
    scale = ones_logits.abs().amax(dim=-1, keepdim=True)
    top2 = ones_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * BF16_TOLERANCE * scale[..., 0]
    for rank in range(world):
        got = torch.load(f"{tmp_path / 'out'}.rank{rank}", weights_only=False)
        assert got["heads"] == (32 // world, 8 // world), got["heads"]
        assert got["device"] == f"cuda:{rank}", got["device"]
        assert got["captures"] == 1, got["captures"]  # one graph replayed, collectives inside
        error = ((got["forced_logits"] - ones_logits).abs() / scale).amax()
        assert error < BF16_TOLERANCE, f"rank {rank}: relative logit error {error:.3g}"
        assert torch.equal(got["forced_logits"].argmax(-1)[clear], ones_logits.argmax(-1)[clear])
        for row in range(len(first)):  # free-running: the same tokens up to a near tie
            tie = (~clear[row]).nonzero()
            upto = int(tie[0]) + 1 if tie.numel() else ones_tokens.shape[1]
            assert torch.equal(got["tokens"][row, :upto], ones_tokens[row, :upto])
