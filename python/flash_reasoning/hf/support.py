"""What a model must be for its attention to run through flash-reasoning, checked from its
config (and modules) before any work: every unsupported feature is named in one error."""
from __future__ import annotations

import torch

from .. import dispatch

#: The name the attention function is registered under in transformers' AttentionInterface.
#: Not "flash_reasoning": transformers treats every implementation whose name contains "flash"
#: as a flash-attention build and tries to import one.
ATTN_IMPLEMENTATION = "tree_attention"

#: Architectures whose attention adds ALiBi biases (no flag in their configs says so).
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
#: Architectures with learned attention sinks (per-head logits added to the softmax).
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


class UnsupportedModelFeature(ValueError):
    """The model uses attention features the kernels do not implement; ``features`` names
    them."""

    def __init__(self, features: list[str], model_type: str) -> None:
        self.features = features
        super().__init__(f"flash_reasoning.hf cannot run this {model_type or 'model'}'s "
                         f"attention: it uses {', '.join(features)}, which the tree-attention "
                         f"kernels do not implement")


def head_dim_of(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def attention_heads(model) -> tuple[int, int]:
    """The query and KV heads ``model``'s attention runs on this process: the config's, or,
    under tensor parallelism (transformers' ``tp_plan``: projection weights are DTensors),
    this rank's share of them, in the ratio of the projections' local rows to their whole."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for module in model.modules():
        q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if hasattr(module, "layer_idx") and q_proj is not None and k_proj is not None:
            return _rank_share(heads, q_proj.weight), _rank_share(kv_heads, k_proj.weight)
    return heads, kv_heads


def _rank_share(heads: int, weight: torch.Tensor) -> int:
    """``heads`` times the share of ``weight``'s output rows this process holds (all of them
    unless it is a DTensor); whole heads, else a ValueError."""
    if not hasattr(weight, "to_local"):
        return heads
    local, whole = weight.to_local().shape[0], weight.shape[0]
    if (heads * local) % whole or not local:
        raise ValueError(f"this process holds {local} of the {whole} output rows of a "
                         f"projection over {heads} heads, not whole heads: tensor parallelism "
                         f"must give each rank whole heads (at most {heads} ranks)")
    return heads * local // whole


def unsupported_features(config, device: torch.device | str = "cpu",
                         dtype: torch.dtype | None = None, model=None) -> list[str]:
    """The features of ``config`` (and ``model``'s modules, when given) that this integration
    cannot run on ``device`` in ``dtype``, each named; empty when it can."""
    found = _attention_kind_features(config) + _position_features(config)
    found += _shape_features(config, torch.device(device), dtype)
    if model is not None:
        found += _module_features(model, config)
    return list(dict.fromkeys(found))  # one mention each, in order


def check_model(model, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> None:
    """Raise :class:`UnsupportedModelFeature` naming every feature of ``model`` that this
    integration cannot run (on its device and dtype unless given)."""
    config = model.config
    parameter = next(model.parameters(), None)
    device = device if device is not None else (parameter.device if parameter is not None
                                                else "cpu")
    dtype = dtype if dtype is not None else (parameter.dtype if parameter is not None else None)
    found = unsupported_features(config, device, dtype, model)
    if found:
        raise UnsupportedModelFeature(found, getattr(config, "model_type", ""))


def _attention_kind_features(config) -> list[str]:
    found = []
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                               False):
        found.append("cross-attention (an encoder-decoder model)")
    if not getattr(config, "is_causal", True):
        found.append("bidirectional (non-causal) attention")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in layer_types or (
            not layer_types and getattr(config, "sliding_window", None) is not None):
        found.append(f"sliding window attention (sliding_window={config.sliding_window})")
    for kind in sorted(layer_types - {"full_attention", "sliding_attention"}):
        found.append(f"{kind} layers (layer_types)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        found.append(f"attention logit soft-capping "
                     f"(attn_logit_softcapping={config.attn_logit_softcapping})")
    if getattr(config, "model_type", None) in SINK_MODEL_TYPES:
        found.append("attention sinks")
    if getattr(config, "kv_lora_rank", None) is not None or getattr(config, "q_lora_rank", None):
        found.append("multi-head latent attention (MLA, kv_lora_rank)")
    return found


def _position_features(config) -> list[str]:
    attn_config = getattr(config, "attn_config", None)
    if (getattr(config, "alibi", False) or getattr(config, "model_type", None) in ALIBI_MODEL_TYPES
            or getattr(config, "position_embedding_type", None) == "alibi"
            or getattr(attn_config, "alibi", False)):
        return ["ALiBi position biases"]
    return []


def _shape_features(config, device: torch.device, dtype: torch.dtype | None) -> list[str]:
    if not hasattr(config, "num_attention_heads") or not hasattr(config, "hidden_size"):
        return ["no num_attention_heads/hidden_size in its config (not a decoder LM)"]
    found = []
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads and heads % kv_heads:
        found.append(f"{heads} query heads over {kv_heads} KV heads (not a multiple)")
    if device.type == "cuda":
        head_dim = head_dim_of(config)
        if head_dim not in dispatch.HEAD_DIMS:
            found.append(f"head_dim {head_dim} (the CUDA kernels take {list(dispatch.HEAD_DIMS)})")
        if dtype is not None and str(dtype).removeprefix("torch.") not in dispatch.DTYPES:
            found.append(f"dtype {dtype} on CUDA (the kernels take {list(dispatch.DTYPES)})")
    return found


def _module_features(model, config) -> list[str]:
    """What only the modules show: learned sinks, and attention that bypasses transformers'
    attention interface (where the registered function would never be called)."""
    found = []
    if any(hasattr(module, "sinks") for module in model.modules()):
        found.append("attention sinks")
    if not getattr(model, "_supports_attention_backend", False):
        found.append(f"attention outside transformers' attention interface "
                     f"({type(model).__name__} does not dispatch through it)")
    return found


def enable(model):
    """Check ``model`` (:func:`check_model`), then make its attention the tree attention
    (``model.set_attn_implementation``); returns the model."""
    check_model(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def check_enabled(model) -> None:
    """The model's attention runs through the tree attention, else a ValueError saying how."""
    check_model(model)
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"the model's attention implementation is {implementation!r}; load it "
                         f"with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
                         f"flash_reasoning.hf.enable(model)")


def vocab_size(model) -> int:
    """The rows of the model's input embedding: every token id must lie below it."""
    embeddings = model.get_input_embeddings()
    return int(getattr(embeddings, "num_embeddings", None) or model.config.vocab_size)


def token_ids(name: str, tokens, vocab: int) -> torch.Tensor:
    """``tokens`` as a flat int64 tensor on their device, refused unless integer ids in
    ``[0, vocab)``: an id out of range would fail inside the embedding, on CUDA as a
    device-side assert that ends the process's CUDA context. Reads device tensors back."""
    tensor = torch.as_tensor(tokens)
    if tensor.numel() == 0:
        return tensor.to(torch.long).reshape(-1)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got {tensor.dtype}")
    tensor = tensor.to(torch.long).reshape(-1)
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"{name} holds token id {low if low < 0 else high}, outside the "
                         f"model's vocabulary [0, {vocab})")
    return tensor


def eos_ids(eos_token_id, vocab: int) -> torch.Tensor | None:
    """``eos_token_id`` (one id or several; None: no EOS) as a flat int64 tensor, refused
    outside ``[0, vocab)``: an EOS the model cannot emit would stop no row, silently."""
    if eos_token_id is None:
        return None
    ids = token_ids("eos_token_id", eos_token_id, vocab)
    if ids.numel() == 0:
        raise ValueError("eos_token_id must name at least one token (None: no EOS)")
    return ids
