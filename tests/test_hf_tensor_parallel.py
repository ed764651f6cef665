"""flash_reasoning.hf under transformers' tensor parallelism (``tp_plan="auto"``, two CPU
ranks over gloo): each rank's cache holds its share of the KV heads and every rank applies the
same tree operations; the greedy continuations and their logits equal transformers' on one
process, and beam search gives the one-process beams."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a tp_plan through it

import hf_tensor_parallel_worker as worker  # noqa: E402

from conftest import free_port  # noqa: E402
from flash_reasoning.hf import beam_search  # noqa: E402
from flash_reasoning.hf.models import random_model, twin  # noqa: E402

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
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
         f"--master_port={free_port()}", str(here / "hf_tensor_parallel_worker.py"),
         str(root / "out"), *dirs], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
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
