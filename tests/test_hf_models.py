"""flash_reasoning.hf.models: random-weight models of any attention shape, reproducible from
a seed, in the dtype asked for, and twins that share weights but not the config."""
import pytest
import torch

pytest.importorskip("transformers")

from flash_reasoning.hf import ATTN_IMPLEMENTATION
from flash_reasoning.hf.models import random_model, twin


def test_shapes_dtype_and_seed():
    model = random_model("qwen2", 28, 4, 64, num_layers=1, dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (28 * 64, 56)  # hidden: the first multiple of 28 >= 32
    assert attn.k_proj.weight.shape == (4 * 64, 56)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    again = random_model("qwen2", 28, 4, 64, num_layers=1, dtype=torch.bfloat16)
    assert torch.equal(attn.q_proj.weight, again.model.layers[0].self_attn.q_proj.weight)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION and not model.training


def test_twin_has_the_weights_and_its_own_config():
    model = random_model("llama", 4, 2, 16, num_layers=1)
    other = twin(model)
    assert other.config is not model.config
    assert other.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_unknown_architecture():
    with pytest.raises(ValueError, match="arch must be one of"):
        random_model("gpt2", 4, 2, 16)
