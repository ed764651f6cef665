"""flash_reasoning.hf.cache: TreeCache stores a model's K/V in one allocator; fork, free,
crop and beam reordering are allocator operations (no block is copied by them), and the
model's outputs match transformers' own attention over the same histories."""
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache

from conftest import allocator_snapshot, assert_allocator_unchanged
from flash_reasoning.hf import TreeCache
from flash_reasoning.hf.models import random_model, twin

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
#: float32 logits of these models are O(10): a few ulps of error each.
FP32 = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def models():
    model = random_model("llama", 8, 2, 16, num_layers=2)
    return model, twin(model)


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def forward(model, cache, ids):
    """One forward of ``ids`` ``[rows, new]`` at each row's length; last-position logits."""
    with torch.no_grad():
        out = model(ids, past_key_values=cache, position_ids=cache.position_ids(ids.shape[1]),
                    use_cache=True)
    return out.logits[:, -1]


def reference(ref, histories):
    """transformers' logits after each history (a full forward, no cache)."""
    with torch.no_grad():
        return torch.cat([ref(h[None]).logits[:, -1] for h in histories])


def prefilled(model, prompt, block_size=4, num_blocks=128):
    cache = TreeCache(model, num_blocks, block_size)
    root = cache.new_branch()
    cache.set_batch([root])
    logits = forward(model, cache, prompt[None])
    return cache, root, logits


def test_prefill_fork_and_decode_match_transformers(models):
    model, ref = models
    prompt = tokens(13, 0)
    cache, root, logits = prefilled(model, prompt)
    torch.testing.assert_close(logits, reference(ref, [prompt]), **FP32)
    kids = cache.fork(root, 3)
    cache.free(root)
    cache.set_batch(kids)
    histories = [prompt.clone() for _ in kids]
    step = torch.tensor([[5], [6], [7]])
    for _ in range(4):
        logits = forward(model, cache, step)
        histories = [torch.cat([h, s]) for h, s in zip(histories, step)]
        torch.testing.assert_close(logits, reference(ref, histories), **FP32)
        step = logits.argmax(-1, keepdim=True)


def test_fork_and_regroup_copy_no_blocks(models):
    model, _ = models
    cache, root, _ = prefilled(model, tokens(13, 1))  # 3 full blocks of 4 and 1 partial
    used = cache.allocator.memory_report().blocks_used
    kids = cache.fork(root, 5)
    cache.set_batch(kids)
    cache.regroup([0, 0, 1, 3, 3])  # rows 2 and 4 freed, rows 0 and 3 forked once more
    assert len(cache.branch_ids) == 5 and len(set(cache.branch_ids)) == 5
    assert cache.branch_ids[0] == kids[0] and cache.branch_ids[2] == kids[1]
    assert not cache.allocator.is_alive(kids[2]) and not cache.allocator.is_alive(kids[4])
    assert cache.allocator.memory_report().blocks_used == used
    forward(model, cache, torch.arange(5)[:, None])
    # The step's writes copy the one shared partial block, once per row but its last holder.
    assert cache.allocator.memory_report().blocks_used == used + 5


def test_a_refused_or_failed_regroup_changes_nothing(models, monkeypatch):
    model, _ = models
    cache, root, _ = prefilled(model, tokens(9, 1))
    kids = cache.fork(root, 3)
    cache.set_batch(kids)
    live = cache.allocator.live_branch_ids()
    cache.begin_step(1)  # a step opened for a forward: a refused call keeps it too
    before = allocator_snapshot(cache.allocator)
    with pytest.raises(ValueError, match="at least one row"):
        cache.regroup([])
    with pytest.raises(ValueError, match="must lie in \\[0, 2\\]"):
        cache.regroup([0, 3])
    assert_allocator_unchanged(cache.allocator, before)
    assert cache.step_kind == "decode"
    cache.rollback()
    forks = []
    alloc = cache.allocator.alloc_branch

    def second_fork_fails(*args, **kwargs):
        if forks:
            raise RuntimeError("no branch left")
        forks.append(alloc(*args, **kwargs))
        return forks[-1]

    monkeypatch.setattr(cache.allocator, "alloc_branch", second_fork_fails)
    with pytest.raises(RuntimeError, match="no branch left"):
        cache.regroup([1, 1, 1])  # keeps kids[1], forks it twice: the second fork fails
    assert len(forks) == 1
    assert cache.branch_ids == kids and cache.allocator.live_branch_ids() == live


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams"])
def test_transformers_generate_runs_over_a_tree_cache(models, beams):
    """transformers' own greedy and beam-search loops over a TreeCache (beams reordered by
    reorder_cache each step) give its sequences with its DynamicCache."""
    model, ref = models
    prompt = tokens(11, 2)[None]
    cache = TreeCache(model, 256, 4)
    cache.set_batch([cache.new_branch() for _ in range(beams)])
    args = {"num_beams": beams, "num_return_sequences": beams, "max_new_tokens": 12,
            "do_sample": False}
    ours = model.generate(prompt, past_key_values=cache, **args)
    theirs = ref.generate(prompt, **args)
    assert torch.equal(ours, theirs)


def test_crop_removes_tokens_in_place(models):
    model, ref = models
    prompt = tokens(13, 3)
    cache, root, _ = prefilled(model, prompt)
    cache.crop(-3)
    assert cache.lengths() == [10] and cache.branch_ids == [root]  # nothing copied, same id
    logits = forward(model, cache, torch.tensor([[9]]))
    torch.testing.assert_close(logits, reference(ref, [torch.cat([prompt[:10],
                                                                  torch.tensor([9])])]),
                               **FP32)
    cache.crop(5)  # transformers' legacy meaning: cut to this length
    assert cache.lengths() == [5]


def test_a_forward_that_raises_midway_is_rolled_back(models, monkeypatch):
    model, ref = models
    prompt = tokens(9, 4)
    cache, root, _ = prefilled(model, prompt)
    kids = cache.fork(root, 2)
    cache.set_batch(kids)
    mlp = model.model.layers[0].mlp  # after layer 0 stored its K/V, before layer 1

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(mlp, "forward", fail)
    with pytest.raises(RuntimeError, match="boom"):
        forward(model, cache, torch.tensor([[1], [2]]))
    monkeypatch.undo()
    assert cache.lengths() == [9, 9]  # layer 0's K/V of the failed step are gone
    logits = forward(model, cache, torch.tensor([[1], [2]]))
    histories = [torch.cat([prompt, torch.tensor([t])]) for t in (1, 2)]
    torch.testing.assert_close(logits, reference(ref, histories), **FP32)


def test_update_names_what_is_wrong(models):
    model, _ = models
    cache, root, _ = prefilled(model, tokens(5, 5))
    cache.set_batch([root])
    k = torch.zeros(2, 2, 1, 16)
    with pytest.raises(ValueError, match="must be \\[1 rows"):
        cache.update(k, k, 0)
    with pytest.raises(TypeError, match="pool's dtype"):
        cache.update(k[:1].double(), k[:1].double(), 0)
    with pytest.raises(RuntimeError, match="not the next layer"):
        cache.update(k[:1], k[:1], 1)
    assert cache.lengths() == [5]


def test_ragged_rows_have_no_one_sequence_length(models):
    model, _ = models
    cache, root, _ = prefilled(model, tokens(7, 6))
    short = cache.new_branch()
    cache.set_batch([root, short])
    with pytest.raises(ValueError, match="lengths differ"):
        cache.get_seq_length()
    assert cache.position_ids(2).tolist() == [[7, 8], [0, 1]]


def test_rows_of_different_lengths_decode_together(models):
    """Rows at different positions (position_ids per row) in one decode step."""
    model, ref = models
    a, b = tokens(6, 7), tokens(11, 8)
    cache = TreeCache(model, 64, 4)
    rows = []
    for prompt in (a, b):
        rows.append(cache.new_branch())
        cache.set_batch([rows[-1]])
        forward(model, cache, prompt[None])
    cache.set_batch(rows)
    logits = forward(model, cache, torch.tensor([[3], [4]]))
    expected = reference(ref, [torch.cat([a, torch.tensor([3])]),
                               torch.cat([b, torch.tensor([4])])])
    torch.testing.assert_close(logits, expected, **FP32)


def test_copies_store_every_path_and_paged_decode_reads_them(models):
    """fork(share=False) gives each branch its own blocks (the no-sharing baseline); the
    paged backend decodes them to the tree backend's logits."""
    model, _ = models
    prompt = tokens(13, 9)
    results = []
    for attention, share in (("tree", True), ("paged", False)):
        cache = TreeCache(model, 128, 4, attention=attention)
        root = cache.new_branch()
        cache.set_batch([root])
        forward(model, cache, prompt[None])
        used = cache.allocator.memory_report().blocks_used
        kids = cache.fork(root, 3, share=share)
        assert cache.allocator.memory_report().blocks_used == used * (1 if share else 4)
        cache.free(root)
        cache.set_batch(kids)
        results.append(forward(model, cache, torch.tensor([[1], [2], [3]])))
    torch.testing.assert_close(results[0], results[1], **FP32)


def test_dynamic_cache_with_the_tree_attention_is_refused(models):
    model, _ = models
    with pytest.raises(RuntimeError, match="past_key_values=TreeCache"), torch.no_grad():
        model(tokens(4, 10)[None], past_key_values=DynamicCache(config=model.config))
