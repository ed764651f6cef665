"""flash_reasoning.hf.support: every attention feature the kernels do not implement is named
at setup, from the config (and modules), before any work; supported models pass."""
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flash_reasoning.hf import (  # noqa: E402 (after the importorskip)
    ATTN_IMPLEMENTATION,
    TreeCache,
    UnsupportedModelFeature,
    check_model,
    enable,
    unsupported_features,
)
from flash_reasoning.hf.models import random_model  # noqa: E402
from flash_reasoning.hf.support import attention_heads, check_enabled  # noqa: E402

SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 32, "vocab_size": 32}


def gqa(**extra):
    return dict(SMALL, num_key_value_heads=2, head_dim=8, **extra)


UNSUPPORTED = {
    "mistral": (lambda: transformers.MistralConfig(**gqa(sliding_window=16)),
                ["sliding window"]),
    "qwen2_sliding": (lambda: transformers.Qwen2Config(**dict(
        SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
        max_window_layers=0)), ["sliding window"]),
    "gemma2": (lambda: transformers.Gemma2Config(**gqa()), ["sliding window",
                                                           "soft-capping"]),
    "gpt_oss": (lambda: transformers.GptOssConfig(**gqa(num_local_experts=2,
                                                        num_experts_per_tok=1)),
                ["sliding window", "attention sinks"]),
    "falcon_alibi": (lambda: transformers.FalconConfig(hidden_size=32, num_attention_heads=4,
                                                       num_hidden_layers=1, vocab_size=32,
                                                       alibi=True), ["ALiBi"]),
    "bloom": (lambda: transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=1,
                                               vocab_size=32), ["ALiBi"]),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(
        **dict(SMALL, num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16,
               q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)), ["MLA"]),
    "bart": (lambda: transformers.BartConfig(d_model=32, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_layers=1,
                                             decoder_layers=1, vocab_size=32),
             ["cross-attention"]),
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(**gqa(num_hidden_layers=4)),
                   ["linear_attention"]),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_feature_is_named(name):
    make, expected = UNSUPPORTED[name]
    found = " | ".join(unsupported_features(make()))
    for feature in expected:
        assert feature in found, (name, found)


@pytest.mark.parametrize("config", [
    lambda: transformers.LlamaConfig(**gqa()),
    lambda: transformers.Qwen2Config(**dict(SMALL, num_key_value_heads=2)),
], ids=["llama", "qwen2"])
def test_supported_configs_pass_on_cpu(config):
    assert unsupported_features(config()) == []


def test_cuda_names_head_dim_and_dtype_the_kernels_lack():
    config = transformers.LlamaConfig(**gqa())  # head_dim 8
    found = " | ".join(unsupported_features(config, "cuda", torch.float32))
    assert "head_dim 8" in found and "float32 on CUDA" in found
    config = transformers.LlamaConfig(**dict(SMALL, num_key_value_heads=2, head_dim=128))
    assert unsupported_features(config, "cuda", torch.bfloat16) == []


def test_model_setup_raises_before_allocating():
    """TreeCache of a sliding-window model fails naming the feature, before its pool exists."""
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**gqa(sliding_window=16)))
    with pytest.raises(UnsupportedModelFeature, match="sliding window") as info:
        TreeCache(model, num_blocks=1 << 40)  # a pool this size would fail if it were made
    assert info.value.features and "mistral" in str(info.value)


def test_module_scan_finds_sinks_and_attention_outside_the_interface():
    oss = transformers.GptOssForCausalLM(UNSUPPORTED["gpt_oss"][0]())
    with pytest.raises(UnsupportedModelFeature, match="attention sinks"):
        check_model(oss)
    falcon = transformers.FalconForCausalLM(UNSUPPORTED["falcon_alibi"][0]())
    with pytest.raises(UnsupportedModelFeature, match="attention interface"):
        check_model(falcon)


def test_enable_selects_the_tree_attention_by_a_name_without_flash():
    """transformers takes any implementation named with "flash" for a flash-attention build."""
    assert "flash" not in ATTN_IMPLEMENTATION
    model = random_model("llama", 4, 2, 8, num_layers=1, hidden_size=16,
                         attn_implementation="sdpa")
    with pytest.raises(ValueError, match="enable"):
        check_enabled(model)
    assert enable(model) is model
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    check_enabled(model)


class ShardedWeight:
    """A DTensor's two shapes: ``shape`` the whole weight's, ``to_local()`` this rank's."""

    def __init__(self, whole_rows: int, local_rows: int) -> None:
        self.shape = (whole_rows, 16)
        self._local = torch.empty(local_rows, 16)

    def to_local(self) -> torch.Tensor:
        return self._local


def fake_model(q_weight, k_weight, heads=28, kv_heads=4):
    attention = SimpleNamespace(layer_idx=0, q_proj=SimpleNamespace(weight=q_weight),
                                k_proj=SimpleNamespace(weight=k_weight))
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
    return SimpleNamespace(config=config, modules=lambda: iter([attention]))


def test_attention_heads_are_the_configs_or_this_ranks_share():
    assert attention_heads(random_model("qwen2", 28, 4, 64)) == (28, 4)
    assert attention_heads(fake_model(torch.empty(28 * 64, 8), torch.empty(4 * 64, 8))) == (28, 4)
    # two ranks (transformers' tp_plan): half the rows of each projection, half the heads
    assert attention_heads(fake_model(ShardedWeight(28 * 64, 14 * 64),
                                      ShardedWeight(4 * 64, 2 * 64))) == (14, 2)
    # a gated projection (twice the rows a head) shards alike
    assert attention_heads(fake_model(ShardedWeight(56 * 64, 14 * 64),
                                      ShardedWeight(4 * 64, 64))) == (7, 1)


@pytest.mark.parametrize("k_local", [32, 0], ids=["half_a_head", "no_head"])
def test_attention_heads_refuses_ranks_without_whole_kv_heads(k_local):
    model = fake_model(ShardedWeight(28 * 64, 28 * 8), ShardedWeight(4 * 64, k_local))
    with pytest.raises(ValueError, match="whole heads"):
        attention_heads(model)
