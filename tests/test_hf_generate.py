"""flash_reasoning.hf.generate against transformers itself, on the same random weights:
greedy parallel sampling and tree-of-thought continuations give transformers' tokens (its
sdpa attention, separate per-sequence caches) for 64 steps with float32 logits within
tolerance, across Llama and Qwen2 with GQA groups 1, 4, 7 and 8 and head_dim 64 and 128; beam
search gives ``generate(num_beams=k)``'s sequences and scores. The GPU tests do the same at
real sizes in float16 and bfloat16."""
import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from conftest import gpu
from flash_reasoning import PoolExhausted
from flash_reasoning.hf import Sampling, ThoughtTree, TreeCache, beam_search, sample
from flash_reasoning.hf.models import random_model, twin
from hf_decoding import HALF_TOLERANCE, teacher_forced_logits

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 64
VOCAB = 128


def assert_logits_close(ours, theirs, tolerance=1e-5):
    """Within ``tolerance`` of the reference's largest logit (float32 rounding grows with
    the logits' scale)."""
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance * theirs.abs().max())

#: (arch, query heads, KV heads, head_dim): GQA groups 1, 4, 7 (28/4) and 8, head_dim 64 and
#: 128, each group on both architectures.
SHAPES = [("llama", 4, 4, 64), ("llama", 16, 4, 128), ("llama", 28, 4, 64),
          ("llama", 16, 2, 128), ("qwen2", 4, 4, 128), ("qwen2", 8, 2, 64),
          ("qwen2", 28, 4, 128), ("qwen2", 8, 1, 64)]


def shape_id(shape):
    arch, q, kv, d = shape
    return f"{arch}-q{q}kv{kv}-d{d}"


def pair(shape, **kwargs):
    model = random_model(*shape, **kwargs)
    return model, twin(model)


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_greedy(ref, rows: torch.Tensor, new_tokens: int):
    """transformers' greedy continuation of each row (equal lengths: one batch, each row its
    own cache), with the logits of each step."""
    out = ref.generate(rows, do_sample=False, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, output_logits=True,
                       return_dict_in_generate=True)
    return out.sequences[:, rows.shape[1]:], torch.stack(out.logits, dim=1).float()


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_parallel_sampling_fork_matches_separate_sequences(shape):
    """One prompt prefilled once and forked 3 times, each fork forced to its own first token,
    then greedy: each equals transformers decoding prompt + that token on its own."""
    model, ref = pair(shape)
    prompt, first = tokens(13, 1), [7, 42, 99]
    ours = sample(model, prompt, 3, STEPS, first_tokens=first, return_logits=True)
    rows = torch.cat([prompt.expand(3, -1), torch.tensor(first)[:, None]], dim=1)
    theirs, logits = hf_greedy(ref, rows, STEPS - 1)
    assert torch.equal(ours.tokens[:, 1:], theirs)
    assert_logits_close(ours.logits[:, 1:], logits)


@pytest.mark.parametrize("shape", [SHAPES[7]], ids=shape_id)
def test_thought_tree_continuations_match_separate_sequences(shape):
    """Children with their own continuation prompts (of different lengths), generated
    together: each equals transformers on prompt + continuation."""
    model, ref = pair(shape)
    prompt = tokens(10, 2)
    continuations = [tokens(3, 3).tolist(), tokens(7, 4).tolist(), tokens(1, 5).tolist()]
    tree = ThoughtTree(model, prompt, max_tokens=1024, cuda_graphs=False)
    children = tree.expand(tree.root, continuations)
    generated = tree.generate(children, STEPS)
    for child, cont, got in zip(children, continuations, generated):
        theirs, _ = hf_greedy(ref, torch.cat([prompt, torch.tensor(cont)])[None], STEPS)
        assert got == theirs[0].tolist()
        assert child.path_tokens() == prompt.tolist() + cont + got


def test_thought_tree_grandchildren_continue_generated_thoughts():
    """Expand a node that generated (its last token not yet in its branch), generate again,
    prune a sibling: the paths still equal transformers' continuation of the whole path."""
    model, ref = pair(SHAPES[1])
    tree = ThoughtTree(model, tokens(8, 6), max_tokens=1024, cuda_graphs=False)
    a, b = tree.expand(tree.root, [[1, 2], [3]])
    tree.generate([a, b], 5)
    a1, a2 = tree.expand(a, [[4, 5, 6], []])
    tree.prune(b)
    assert not b.alive and tree.leaves() == [a1, a2]
    first = tree.generate([a1, a2], 9)
    more = tree.generate([a1], 4)[0]  # again from a1: its pending token is fed first
    for node, got in ((a1, first[0] + more), (a2, first[1])):
        history = node.path_tokens()[:-len(got)]
        theirs, _ = hf_greedy(ref, torch.tensor(history)[None], len(got))
        assert got == theirs[0].tolist()
    a1.score, a2.score = 0.2, 0.9
    assert tree.best(1) == [a2]
    with pytest.raises(ValueError, match="leaves"):
        tree.generate([a], 2)


BEAM_SETTINGS = [{"length_penalty": 1.0, "early_stopping": False},
                 {"length_penalty": 2.0, "early_stopping": True},
                 {"length_penalty": 0.5, "early_stopping": "never"}]


@pytest.mark.parametrize("with_eos", [False, True], ids=["no_eos", "eos"])
@pytest.mark.parametrize("settings", BEAM_SETTINGS, ids=["lp1", "lp2_early", "lp05_never"])
def test_beam_search_matches_transformers(settings, with_eos):
    model, ref = pair(SHAPES[5])
    prompt, k, new = tokens(9, 7), 4, 16
    args = dict(num_beams=k, num_return_sequences=k, max_new_tokens=new, **settings)
    eos = None
    if with_eos:  # two tokens the best beams emit early: hypotheses finish on the way
        plain = ref.generate(prompt[None], do_sample=False, **args)
        eos = [int(plain[0, 9 + 3]), int(plain[1, 9 + 6])]
    theirs = ref.generate(prompt[None], do_sample=False, eos_token_id=eos, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True, **args)
    ours = beam_search(model, prompt, k, new, eos_token_id=eos, pad_token_id=0,
                       num_return_sequences=k, cuda_graphs=False, **settings)
    assert torch.equal(ours.sequences, theirs.sequences[:, 9:])
    assert_logits_close(ours.scores, theirs.sequences_scores)


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model, _ = pair(SHAPES[0])
    prompt = tokens(6, 8)

    def sampled(seed, **kwargs):
        rule = Sampling(do_sample=True, generator=torch.Generator().manual_seed(seed), **kwargs)
        return sample(model, prompt, 4, 12, sampling=rule, cuda_graphs=False).tokens

    first = sampled(0, temperature=1.5, top_p=0.9)
    assert torch.equal(first, sampled(0, temperature=1.5, top_p=0.9))
    assert len({tuple(row) for row in first.tolist()}) > 1  # the continuations differ
    greedy = sample(model, prompt, 4, 12, cuda_graphs=False).tokens
    assert torch.equal(sampled(1, top_k=1), greedy)


def test_eos_ends_each_continuation_and_pads_it():
    model, _ = pair(SHAPES[0])
    prompt = tokens(6, 9)
    plain = sample(model, prompt, 3, 16, first_tokens=[1, 2, 3], cuda_graphs=False).tokens
    eos = int(plain[0, 4])
    ended = sample(model, prompt, 3, 16, first_tokens=[1, 2, 3], eos_token_id=eos,
                   pad_token_id=-1, cuda_graphs=False)
    for row, length in zip(range(3), ended.lengths):
        expected = plain[row].tolist()
        if eos in expected:
            stop = expected.index(eos) + 1
            assert length == stop
            assert ended.tokens[row, :stop].tolist() == expected[:stop]
            assert (ended.tokens[row, stop:] == -1).all()
        else:
            assert length == ended.tokens.shape[1] and ended.tokens[row].tolist() == expected
    assert ended.lengths[0] == 5


def test_inputs_are_checked_before_any_work():
    model, _ = pair(SHAPES[0])
    with pytest.raises(ValueError, match="first_tokens must hold n=3"):
        sample(model, tokens(4, 10), 3, 8, first_tokens=[1])
    with pytest.raises(ValueError, match="prompt must hold"):
        sample(model, [], 2, 8)
    with pytest.raises(ValueError, match="num_return_sequences"):
        beam_search(model, tokens(4, 10), 2, 8, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping must be"):
        beam_search(model, tokens(4, 10), 2, 8, early_stopping="sometimes")
    outside = f"outside the model's vocabulary \\[0, {VOCAB}\\)"
    for run in (lambda: sample(model, [1, VOCAB], 2, 8),
                lambda: sample(model, tokens(4, 10), 2, 8, first_tokens=[0, -1]),
                lambda: beam_search(model, [VOCAB + 5], 2, 8),
                lambda: ThoughtTree(model, [-3], cuda_graphs=False)):
        with pytest.raises(ValueError, match=outside):
            run()
    with pytest.raises(TypeError, match="integer token ids"):
        sample(model, torch.tensor([1.5, 2.0]), 2, 8)
    tree = ThoughtTree(model, tokens(4, 10), cuda_graphs=False)
    for run in (lambda: sample(model, tokens(4, 10), 2, 8, eos_token_id=VOCAB),
                lambda: beam_search(model, tokens(4, 10), 2, 8, eos_token_id=[3, -1]),
                lambda: tree.generate([tree.root], 4, eos_token_id=VOCAB + 1)):
        with pytest.raises(ValueError, match="eos_token_id holds token id"):
            run()
    for run, match in ((lambda: sample(model, tokens(4, 10), 2, 8, eos_token_id=[]),
                        "eos_token_id must name"),
                       (lambda: tree.generate([], 4), "at least one leaf"),
                       (lambda: tree.generate([tree.root], 0), "max_new_tokens must be >= 1")):
        with pytest.raises(ValueError, match=match):
            run()
    with pytest.raises(TypeError, match="pad_token_id must be an int"):
        beam_search(model, tokens(4, 10), 2, 8, pad_token_id="<pad>")
    assert tree.root.tokens == tokens(4, 10).tolist() and tree.root.pending is None
    for bad, match in (({"temperature": 0.0}, "temperature"), ({"top_k": 0}, "top_k"),
                       ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=match):
            Sampling(do_sample=True, **bad)
    plain = random_model(*SHAPES[0], attn_implementation="sdpa")
    for run in (lambda: sample(plain, tokens(4, 10), 2, 8),
                lambda: beam_search(plain, tokens(4, 10), 2, 8),
                lambda: ThoughtTree(plain, tokens(4, 10))):
        with pytest.raises(ValueError, match="flash_reasoning.hf.enable"):
            run()


def test_a_failed_call_leaves_a_given_cache_as_it_was():
    """sample and beam_search free the branches they made when they fail (beam search also
    when it returns: its output names none); a cache passed in keeps what it held."""
    model, _ = pair(SHAPES[0])
    cache = TreeCache(model, 4, 4)  # 12 tokens a branch: the prompt fits, 10 new ones do not
    held = cache.new_branch()
    for run in (lambda: sample(model, tokens(6, 1), 2, 10, cache=cache, cuda_graphs=False),
                lambda: beam_search(model, tokens(6, 1), 2, 10, cache=cache, cuda_graphs=False)):
        with pytest.raises((PoolExhausted, ValueError)):
            run()
        assert cache.allocator.live_branch_ids() == [held]
    beam_search(model, tokens(6, 1), 2, 2, cache=cache, cuda_graphs=False)
    assert cache.allocator.live_branch_ids() == [held]


def test_thought_tree_calls_are_all_or_nothing():
    """An expand with one bad continuation adds no child; a generate that runs out of blocks
    leaves every node and branch as before, and the tree goes on."""
    model, _ = pair(SHAPES[0])
    tree = ThoughtTree(model, tokens(6, 1), max_tokens=40, cuda_graphs=False)
    live = tree.cache.allocator.live_branch_ids()
    with pytest.raises(ValueError, match="vocabulary"):
        tree.expand(tree.root, [[1, 2], [VOCAB]])
    assert tree.root.children == [] and tree.cache.allocator.live_branch_ids() == live
    a, b = tree.expand(tree.root, [[1, 2], [3]])
    tree.generate([a, b], 2)
    before = [(node.tokens[:], node.pending, tree.cache.length(node.branch_id))
              for node in (a, b)]
    with pytest.raises(PoolExhausted):
        tree.generate([a, b], 64)
    assert [(node.tokens, node.pending, tree.cache.length(node.branch_id))
            for node in (a, b)] == before
    assert [len(new) for new in tree.generate([a, b], 3)] == [3, 3]


def test_dropped_results_free_their_cache_at_once():
    """No reference cycle holds a cache: dropping what ``sample`` returned or a ThoughtTree
    frees its pools (and on CUDA its decode graphs, which may hold NCCL's communicator)
    without waiting for a garbage collection."""
    model, _ = pair(SHAPES[0])

    def grown_tree():
        tree = ThoughtTree(model, tokens(6, 1), max_tokens=256, cuda_graphs=False)
        a, b = tree.expand(tree.root, [[1, 2], [3]])
        tree.generate([a, b], 3)
        tree.prune(b)
        return tree

    def pools_after_drop(make):
        return weakref.ref(make().cache.allocator)

    gc.collect()
    gc.disable()
    try:
        for make in (lambda: sample(model, tokens(5, 2), 3, 4),
                     lambda: sample(model, tokens(5, 2), 3, 4, share_prompt=False),
                     lambda: sample(model, tokens(5, 2), 3, 4, cuda_graphs=True),  # graph path
                     grown_tree):
            assert pools_after_drop(make)() is None
    finally:
        gc.enable()

# ---- GPU: real sizes, float16 and bfloat16 --------------------------------------------

#: Llama-3-8B's and Qwen2.5-7B's attention shapes (2 layers: the attention path at full size).
GPU_SHAPES = [("llama", 32, 8, 128, 4096, 14336), ("qwen2", 28, 4, 128, 3584, 18944)]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s[0])
def test_gpu_real_size_greedy_and_logits_match_transformers(shape, dtype):
    """Greedy continuations of forks, teacher-forced with transformers' own tokens: every
    step's logits within the dtype's tolerance, the same argmax wherever transformers' top
    two differ by more than that tolerance; the tokens themselves equal while no such near
    tie came up (half precision may break a tie the other way)."""
    arch, q, kv, d, hidden, inter = shape
    model, ref = pair((arch, q, kv, d), num_layers=2, hidden_size=hidden,
                      intermediate_size=inter, vocab_size=32000, dtype=dtype, device="cuda",
                      init_std=0.02)
    prompt = tokens(300, 11).cuda()
    first = [5, 17, 99, 1234]
    rows = torch.cat([prompt.expand(4, -1), torch.tensor(first, device="cuda")[:, None]], 1)
    theirs, their_logits = hf_greedy(ref, rows, STEPS - 1)
    forced = torch.cat([torch.tensor(first, device="cuda")[:, None], theirs], dim=1)
    ours, captures = teacher_forced_logits(model, prompt, forced)
    assert captures == 1
    scale = their_logits.abs().amax(dim=-1, keepdim=True)
    error = ((ours - their_logits).abs() / scale).amax()
    assert error < HALF_TOLERANCE[dtype], f"relative logit error {error:.3g}"
    top2 = their_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * HALF_TOLERANCE[dtype] * scale[..., 0]
    assert torch.equal(ours.argmax(-1)[clear], their_logits.argmax(-1)[clear])


@gpu
@pytest.mark.parametrize("attention", ["paged", "tree"])
def test_gpu_beam_search_matches_transformers_in_bfloat16(attention):
    """The best beam (the others' order may turn on bfloat16 rounding of near-equal scores;
    the algorithm itself is checked exactly in float32 above), through its own cache (paged:
    one CUDA graph replayed across the regroups) and through a tree cache (eager steps)."""
    model, ref = pair(("llama", 32, 8, 128), num_layers=2, hidden_size=1024, vocab_size=4096,
                      dtype=torch.bfloat16, device="cuda")
    prompt = tokens(100, 12).cuda()
    theirs = ref.generate(prompt[None], do_sample=False, num_beams=4, max_new_tokens=16)
    cache = TreeCache(model, 64, 16) if attention == "tree" else None
    ours = beam_search(model, prompt, 4, 16, cache=cache)
    assert torch.equal(ours.sequences, theirs[:, 100:])
