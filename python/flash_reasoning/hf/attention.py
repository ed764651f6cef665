"""The attention function registered in transformers' ``AttentionInterface`` as
``"tree_attention"``: decode steps through the cache's plan (one per step, ``run`` per layer),
extend steps (several new tokens per row) through ``tree_attention`` with ``q_lens``, a
prompt by PyTorch SDPA."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from ..ops.tree_attention import tree_attention
from .cache import take_active
from .support import ATTN_IMPLEMENTATION

#: Keyword arguments some architectures pass to their attention function for features the
#: kernels do not implement; a non-None value is refused (``support`` refuses such models at
#: setup: this catches a model that slipped past it).
UNSUPPORTED_KWARGS = {"sliding_window": "sliding window attention",
                      "softcap": "attention logit soft-capping", "s_aux": "attention sinks",
                      "position_bias": "additive position biases (ALiBi, relative)"}


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[rows, heads, new, head_dim]``;
    returns ``([rows, new, heads, head_dim], None)``. The K/V were stored by the
    :class:`~flash_reasoning.hf.cache.TreeCache` whose ``update`` ran just before.

    Under ``torch.compile`` the decode attention is the custom op
    ``flash_reasoning::tree_attention_run`` (``ops/library.py``), and the host-side work (the
    checks, extend steps) runs outside the graph."""
    if torch.compiler.is_compiling():
        return _compiled_forward(module, query, key, value, attention_mask, scaling, dropout,
                                 kwargs)
    layer = module.layer_idx
    cache = _checked_cache(layer, query, attention_mask, scaling, dropout, kwargs)
    if cache.step_kind == "decode":
        return cache.decode_attention(query[:, :, 0].contiguous(), layer).unsqueeze(1), None
    return _extend_attention(cache, query, key, value, layer), None


def _compiled_forward(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    layer = module.layer_idx
    cache = _checked_cache_eager(layer, query, attention_mask, scaling, dropout, kwargs)
    if cache.step_kind != "decode":
        return _extend_attention_eager(cache, query, key, value, layer), None
    q = query[:, :, 0].contiguous()
    handle = cache.plan_handle
    if handle is None:  # the paged (no-sharing) backend has no op: it runs eagerly
        return _decode_attention_eager(cache, q, layer).unsqueeze(1), None
    return torch.ops.flash_reasoning.tree_attention_run(q, handle, layer).unsqueeze(1), None


def _checked_cache(layer, query, attention_mask, scaling, dropout, kwargs):
    cache = take_active(layer)
    _check_call(cache, query, attention_mask, scaling, dropout, kwargs)
    return cache


def register() -> None:
    """Make ``attn_implementation="tree_attention"`` select :func:`tree_attention_forward`."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)


def _check_call(cache, query, attention_mask, scaling, dropout, kwargs) -> None:
    if attention_mask is not None:
        raise ValueError("tree_attention takes no attention mask (got one of shape "
                         f"{tuple(attention_mask.shape)}): rows are never padded, each row "
                         f"attends causally over its own branch")
    if dropout:
        raise ValueError(f"tree_attention has no attention dropout (got dropout={dropout}): "
                         f"call model.eval()")
    for name, feature in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"tree_attention does not implement {feature} (the model passed "
                             f"{name}=...)")
    if kwargs.get("output_attentions"):
        raise ValueError("tree_attention does not return attention weights "
                         "(output_attentions=True)")
    if query.shape[1] != cache.num_qo_heads:
        raise ValueError(f"query has {query.shape[1]} heads, the cache was made for "
                         f"{cache.num_qo_heads}")
    if scaling is not None and scaling != cache.sm_scale:
        raise ValueError(f"the attention module's scaling {scaling} differs from the cache's "
                         f"sm_scale {cache.sm_scale} (taken from the model's attention modules)")


def _extend_attention(cache, query, key, value, layer: int) -> torch.Tensor:
    """Causal attention of each row's new tokens over its path (the new tokens included).
    Rows continuing a path (a continuation after a fork, a draft to verify): one
    ``tree_attention`` call with ``q_lens``, each shared token read once for every row's
    queries. A prompt (every row starting at 0, nothing stored to share): SDPA over the new
    K/V as given."""
    rows, heads, new, head_dim = query.shape
    if not (cache.step_starts == 0).all():
        q = query.transpose(1, 2).reshape(rows * new, heads, head_dim).contiguous()
        out = tree_attention(q, cache.allocator, cache.branch_ids, layer,
                             sm_scale=cache.sm_scale, q_lens=np.full(rows, new))
        return out.view(rows, new, heads, head_dim)
    group = heads // cache.num_kv_heads
    out = F.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
        is_causal=True, scale=cache.sm_scale)
    return out.transpose(1, 2).contiguous()


# What compiled models run outside their graphs: host-side work (the cache's rows, the pool's
# tables) that dynamo must not trace.
_checked_cache_eager = torch.compiler.disable(_checked_cache)
_extend_attention_eager = torch.compiler.disable(_extend_attention)
_decode_attention_eager = torch.compiler.disable(
    lambda cache, q, layer: cache.decode_attention(q, layer))
