"""flash_reasoning.hf.attention: the function registered as attn_implementation
"tree_attention": extend steps (several tokens on a branch that already holds some) match
transformers' attention, and every input it cannot honour is refused, naming it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AttentionInterface

from conftest import GPU_MARKS
from flash_reasoning.hf import ATTN_IMPLEMENTATION, TreeCache, tree_attention_forward
from flash_reasoning.hf.models import random_model, twin

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def models():
    model = random_model("qwen2", 12, 4, 16, num_layers=2)
    return model, twin(model)


def run(model, cache, ids, **kwargs):
    with torch.no_grad():
        return model(ids, past_key_values=cache, position_ids=cache.position_ids(ids.shape[1]),
                     use_cache=True, **kwargs).logits


def test_registered_under_its_name():
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is tree_attention_forward


def test_extend_steps_match_transformers(models):
    """A prompt, then continuations of several tokens on forks: every position's logits."""
    model, ref = models
    gen = torch.Generator().manual_seed(0)
    prompt, more = torch.randint(0, 128, (9,), generator=gen), torch.randint(0, 128, (2, 6),
                                                                               generator=gen)
    cache = TreeCache(model, 64, 4)
    root = cache.new_branch()
    cache.set_batch([root])
    run(model, cache, prompt[None])
    kids = cache.fork(root, 2)
    cache.set_batch(kids)
    ours = run(model, cache, more)  # both rows extend by 6 at position 9
    with torch.no_grad():
        theirs = ref(torch.cat([prompt.expand(2, -1), more], 1)).logits[:, 9:]
    torch.testing.assert_close(ours, theirs, **FP32)
    assert cache.lengths() == [15, 15] and cache.length(root) == 9


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU_MARKS)])
def test_gpu_extend_steps_through_the_kernels_match_transformers(device, dtype):
    """A 300-token prompt, then 4 forks extended by 40 tokens each in one forward (the
    kernels with q_lens): every new position's logits against transformers' on the whole
    rows, within half precision's tolerance (relative to each row's largest logit)."""
    model = random_model("llama", 32, 8, 128, num_layers=2, hidden_size=1024,
                         vocab_size=4096, dtype=dtype, device=device, init_std=0.02)
    ref = twin(model)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 4096, (300,), generator=gen).to(device)
    more = torch.randint(0, 4096, (4, 40), generator=gen).to(device)
    cache = TreeCache(model, 64, 16)
    root = cache.new_branch()
    cache.set_batch([root])
    run(model, cache, prompt[None])
    cache.set_batch(cache.fork(root, 4))
    ours = run(model, cache, more)
    with torch.no_grad():
        theirs = ref(torch.cat([prompt.expand(4, -1), more], 1)).logits[:, 300:]
    scale = theirs.abs().amax(dim=-1, keepdim=True)
    error = ((ours - theirs).abs() / scale).amax().item()
    assert error < {torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype], error


def test_refuses_a_mask_dropout_and_attention_weights(models):
    model, _ = models
    cache = TreeCache(model, 64, 4)
    cache.set_batch([cache.new_branch()])
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="no attention mask"):
        run(model, cache, ids, attention_mask=torch.zeros(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not return attention weights"):
        run(model, cache, ids, output_attentions=True)
    model.train()
    model.config.attention_dropout = 0.1
    try:
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        with pytest.raises(ValueError, match="dropout"):
            run(model, cache, ids)
    finally:
        model.eval()
        model.config.attention_dropout = 0.0
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.0
    assert cache.lengths() == [0]  # each refused forward left nothing behind
    run(model, cache, ids)
    assert cache.lengths() == [3]


class FakeModule:
    layer_idx = 0


def test_refuses_features_passed_as_arguments(models):
    """What a model that slipped past the setup checks would pass: refused by name."""
    model, _ = models
    cache = TreeCache(model, 64, 4)
    cache.set_batch([cache.new_branch()])
    k = torch.zeros(1, 4, 1, 16)
    q = torch.zeros(1, 12, 1, 16)
    for name, feature in (("sliding_window", "sliding window"), ("softcap", "soft-capping"),
                          ("s_aux", "sinks")):
        cache.update(k, k, 0)
        with pytest.raises(ValueError, match=feature):
            tree_attention_forward(FakeModule(), q, k, k, None, **{name: 1.0})
        cache.rollback()
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="scaling"):
        tree_attention_forward(FakeModule(), q, k, k, None, scaling=0.5)
    cache.rollback()
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="heads"):
        tree_attention_forward(FakeModule(), q[:, :8], k, k, None)


def compiled_model_matches_eager(device: str) -> None:
    """torch.compile of a bfloat16 model's forward: decode attention goes through the custom
    op (host-side cache work runs between graphs), with the eager model's tokens and logits.
    Inductor emulates eager's bfloat16 roundings: else its fp32 intermediates alone move this
    model's logits (O(50)) by several units, as they do for transformers' own attention."""
    import torch._inductor.config

    from flash_reasoning import reference
    from flash_reasoning.hf import sample
    from flash_reasoning.ops import library
    torch._inductor.config.emulate_precision_casts = True
    model = random_model("llama", 32, 8, 128, num_layers=2, hidden_size=1024, vocab_size=4096,
                         dtype=torch.bfloat16, device=device)
    prompt = torch.randint(0, 4096, (100,), generator=torch.Generator().manual_seed(0))
    args = {"first_tokens": [1, 2, 3, 4], "cuda_graphs": False, "return_logits": True}
    eager = sample(model, prompt.to(device), 4, 6, **args)
    model.forward = torch.compile(model.forward)
    handles = []
    plan_of = library.plan_of
    library.plan_of = lambda h: (handles.append(h), plan_of(h))[1]
    compiled = sample(model, prompt.to(device), 4, 6, **args)
    assert len(handles) == 5 * 2  # five decode steps, two layers each, through the op
    # Step t's logits follow tokens[:, :t]: compared while the two runs' tokens agree (a
    # near-tie may still flip a greedy token where reductions run in another order).
    same_so_far = (compiled.tokens == eager.tokens).long().cumprod(dim=1).bool()
    comparable = torch.cat([torch.ones_like(same_so_far[:, :1]), same_so_far[:, :-1]], dim=1)
    assert comparable[:, :2].all()  # the prompt and the forced first tokens
    err = reference.relative_error(compiled.logits[comparable], eager.logits[comparable])
    assert err < 1e-2, f"relative error {err} of the compiled model's logits"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU_MARKS)])
def test_compiled_model_decodes_through_the_custom_op(device):
    """compiled_model_matches_eager, in a process where Triton compiles (inductor's kernels);
    this one runs our kernels' CPU tests in Triton's interpreter (conftest)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    code = f"import test_hf_attention as t; t.compiled_model_matches_eager({device!r})"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
