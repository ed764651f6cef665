"""Random-weight models of real architectures, in any shape: what the tests and the
generation benchmark decode (no download: the weights come from a seed); a saved one loaded
sharded over tensor-parallel ranks."""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from .support import ATTN_IMPLEMENTATION

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM),
                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def random_model(arch: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 num_layers: int = 2, hidden_size: int | None = None,
                 intermediate_size: int | None = None,
                 vocab_size: int = 128, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0, init_std: float = 0.4,
                 attn_implementation: str = ATTN_IMPLEMENTATION, **config_kwargs):
    """A model of ``arch`` (``llama`` or ``qwen2``) with these attention shapes and weights
    drawn from ``seed`` (std ``init_std``: 0.4 makes a tiny model's greedy choices varied and
    its top-2 logit gaps far above float32 rounding), in eval mode. ``hidden_size``
    defaults to the smallest multiple of the query heads from 32 (transformers requires a
    multiple); ``config_kwargs`` go to the config (``rope_theta``, ...)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    config_class, model_class = ARCHITECTURES[arch]
    hidden_size = hidden_size or -(-32 // num_qo_heads) * num_qo_heads
    config = config_class(vocab_size=vocab_size, hidden_size=hidden_size,
                          intermediate_size=intermediate_size or 2 * hidden_size,
                          num_hidden_layers=num_layers, num_attention_heads=num_qo_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim,
                          max_position_embeddings=1 << 16, initializer_range=init_std,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None,
                          **config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):  # made in place, in its dtype: no float32 copy of a big model
        model = model_class._from_config(config, dtype=dtype).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def load_tensor_parallel(path, dtype: torch.dtype = torch.float32,
                         attn_implementation: str = ATTN_IMPLEMENTATION):
    """The model saved at ``path`` loaded with transformers' tensor-parallel plan
    (``tp_plan="auto"``) over the initialised ``torch.distributed`` group (torchrun's): each
    rank holds its share of every layer's heads, on its GPU where it has one. A group of one
    rank holds the whole model, on its GPU too (transformers shards nothing and would leave it
    on the CPU). Needs ``accelerate``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    placed = {"device_map": torch.device("cuda", torch.cuda.current_device())} \
        if alone and torch.cuda.is_available() else {}
    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype,
        attn_implementation=attn_implementation, **placed).eval()


def twin(model, attn_implementation: str = "sdpa"):
    """A second model with ``model``'s weights and its own config (attention implementations
    live in the config, so the twin's choice does not change the original's)."""
    other = copy.deepcopy(model)  # the config too: one new config for all its modules
    other.set_attn_implementation(attn_implementation)
    return other
