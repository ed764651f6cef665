"""Hugging Face transformers integration (the ``[hf]`` extra): a cache backed by the KV
allocator, an attention implementation registered as ``attn_implementation="tree_attention"``
(done on import), and reasoning-style generation on top (parallel sampling, beam search, a
tree of thoughts). The only part of flash_reasoning that imports transformers.
"""
from .attention import register, tree_attention_forward
from .cache import TreeCache
from .decoder import TreeDecoder
from .generate import (
    BeamSearchOutput,
    SampleOutput,
    Sampling,
    ThoughtNode,
    ThoughtTree,
    beam_search,
    sample,
)
from .support import (
    ATTN_IMPLEMENTATION,
    UnsupportedModelFeature,
    check_model,
    enable,
    unsupported_features,
)

register()

__all__ = ["ATTN_IMPLEMENTATION", "BeamSearchOutput", "SampleOutput", "Sampling", "ThoughtNode",
           "ThoughtTree", "TreeCache", "TreeDecoder", "UnsupportedModelFeature", "beam_search",
           "check_model", "enable", "register", "sample", "tree_attention_forward",
           "unsupported_features"]
