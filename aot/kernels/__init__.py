"""The @triton.jit kernel sources. Each module holds one family of
``flash_reasoning.specializations``; its parameter order must match the family's."""
from .append_kv import append_kv
from .merge_splits import merge_splits
from .paged_decode import paged_decode
from .tree_attention import tree_final, tree_merge, tree_partial
from .tree_queries import tree_queries

JIT_FUNCTIONS = {fn.__name__: fn for fn in (paged_decode, merge_splits, append_kv,
                                               tree_partial, tree_final, tree_merge,
                                               tree_queries)}
