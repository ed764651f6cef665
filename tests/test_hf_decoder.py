"""flash_reasoning.hf.decoder: the CUDA-graph decode path (fixed input, position, slot and
plan buffers; refreshed before each replay) gives the eager path's tokens, captures once per
tree shape and again only when the tree changes. On CPU ``cuda_graphs=True`` runs the same
buffers without a graph; the GPU tests capture real graphs."""
import pytest
import torch

pytest.importorskip("transformers")

from conftest import gpu
from flash_reasoning.hf import TreeCache, TreeDecoder, beam_search, sample
from flash_reasoning.hf.models import random_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return random_model("llama", 8, 2, 16, num_layers=2)


def prompt(n=11, seed=0):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def decoder_over_forks(model, rows, cuda_graphs, device="cpu"):
    cache = TreeCache(model, 256, 4)
    decoder = TreeDecoder(model, cache, cuda_graphs)
    root = cache.new_branch()
    logits = decoder.extend(root, prompt().to(device))
    cache.set_batch(cache.fork(root, rows))
    cache.free(root)
    return decoder, logits


def greedy(decoder, first, steps):
    tokens, out = first, [first]
    for _ in range(steps):
        tokens = decoder.decode(tokens).argmax(-1)
        out.append(tokens)
    return torch.stack(out, 1)


def test_graph_path_gives_the_eager_tokens_and_captures_once(model):
    first = torch.tensor([3, 4, 5])
    eager, _ = decoder_over_forks(model, 3, cuda_graphs=False)
    graphs, _ = decoder_over_forks(model, 3, cuda_graphs=True)
    assert torch.equal(greedy(eager, first, 20), greedy(graphs, first, 20))
    assert eager.captures == 0 and graphs.captures == 1


def test_a_changed_tree_is_captured_again(model):
    decoder, _ = decoder_over_forks(model, 2, cuda_graphs=True)
    tokens = greedy(decoder, torch.tensor([1, 2]), 4)[:, -1]
    assert decoder.captures == 1
    cache = decoder.cache
    cache.set_batch(cache.branch_ids + cache.fork(cache.branch_ids[0], 1))  # a new tree
    tokens = torch.cat([tokens, tokens[:1]])
    greedy(decoder, tokens, 4)
    assert decoder.captures == 2


def captures_per_step(monkeypatch) -> list[int]:
    """``decoder.captures`` after each decode step of whatever runs next."""
    captures = []
    original = TreeDecoder.decode

    def counting(self, tokens):
        out = original(self, tokens)
        captures.append(self.captures)
        return out

    monkeypatch.setattr(TreeDecoder, "decode", counting)
    return captures


def test_beam_search_replays_one_graph_through_the_paged_backend(model, monkeypatch):
    """Its own cache reads each beam's path (paged): the tables' buffers outlive every
    regroup, so the second step captures and every later one replays; the beams are the
    tree backend's (a plan per step, run eagerly)."""
    tree = beam_search(model, prompt(), 3, 12, num_return_sequences=3, cuda_graphs=False,
                       cache=TreeCache(model, 256, 4))
    captures = captures_per_step(monkeypatch)
    graphs = beam_search(model, prompt(), 3, 12, num_return_sequences=3, cuda_graphs=True)
    assert torch.equal(tree.sequences, graphs.sequences)
    assert captures == [0] + [1] * (len(captures) - 1) and len(captures) > 5


def test_paged_beams_past_the_tables_headroom_capture_again(model, monkeypatch):
    """One-token blocks: 70 new tokens outgrow the tables' 64 columns of headroom, so the
    buffers are made anew (an eager step) and captured once more."""
    tree = beam_search(model, prompt(), 2, 70, cuda_graphs=False,
                       cache=TreeCache(model, 1024, 1), early_stopping="never")
    captures = captures_per_step(monkeypatch)
    graphs = beam_search(model, prompt(), 2, 70, cuda_graphs=True, early_stopping="never",
                         cache=TreeCache(model, 1024, 1, attention="paged"))
    assert torch.equal(tree.sequences, graphs.sequences) and tree.sequences.shape[1] == 70
    assert captures[-1] == 2


def test_beam_search_over_a_tree_cache_captures_only_between_reshuffles(model, monkeypatch):
    """A step whose beams all continue their own branch keeps the tree (and the graph); one
    that forks and frees changes it: an eager step, then a capture if the next keeps it."""
    eager = beam_search(model, prompt(), 3, 12, num_return_sequences=3, cuda_graphs=False)
    captures = captures_per_step(monkeypatch)
    graphs = beam_search(model, prompt(), 3, 12, num_return_sequences=3, cuda_graphs=True,
                         cache=TreeCache(model, 256, 4))
    assert torch.equal(eager.sequences, graphs.sequences)
    assert 0 < captures[-1] < len(captures)  # some steps replayed, some trees changed


def test_a_forward_that_raises_leaves_no_token(model, monkeypatch):
    decoder, _ = decoder_over_forks(model, 2, cuda_graphs=False)
    lengths = decoder.cache.lengths()

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.norm, "forward", fail)  # after every layer's K/V
    with pytest.raises(RuntimeError, match="boom"):
        decoder.decode(torch.tensor([1, 2]))
    monkeypatch.undo()
    assert decoder.cache.lengths() == lengths


def test_inputs_are_checked(model):
    decoder, _ = decoder_over_forks(model, 2, cuda_graphs=False)
    with pytest.raises(ValueError, match="one token per row \\(2\\)"):
        decoder.decode(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="must not be empty"):
        decoder.extend(decoder.cache.branch_ids[0], [])
    lengths = decoder.cache.lengths()
    for call in (lambda: decoder.decode([1, 128]), lambda: decoder.decode(torch.tensor([-1, 0])),
                 lambda: decoder.extend(decoder.cache.branch_ids[0], [5, 128])):
        with pytest.raises(ValueError, match="token id (128|-1), outside the model's "
                                             "vocabulary \\[0, 128\\)"):
            call()
    with pytest.raises(TypeError, match="integer token ids, got torch.float32"):
        decoder.decode(torch.tensor([1.0, 2.0]))
    assert decoder.cache.lengths() == lengths
    plain = random_model("llama", 8, 2, 16, num_layers=2, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        TreeDecoder(plain, TreeCache(plain, 16, 4))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_graph_replays_give_the_eager_tokens(dtype):
    model = random_model("llama", 32, 8, 128, num_layers=2, hidden_size=1024, vocab_size=4096,
                         dtype=dtype, device="cuda")
    args = {"first_tokens": list(range(1, 17)), "cache": None}
    eager = sample(model, prompt(200).cuda(), 16, 48, cuda_graphs=False, **args)
    graphs = sample(model, prompt(200).cuda(), 16, 48, **args)  # graphs by default on CUDA
    assert torch.equal(eager.tokens, graphs.tokens)
