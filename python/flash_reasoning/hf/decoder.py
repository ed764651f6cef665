"""``TreeDecoder``: the forwards of reasoning-style generation over a :class:`TreeCache`:
extend one branch by several tokens, decode one token on every row. A decode step runs in a
CUDA graph by default on CUDA: captured on the second step of a tree (the first runs eagerly,
which also loads every kernel), replayed while the tree keeps its shape (the plan's buffers
and the slots' buffer are fixed; the plan is refreshed before each replay), captured again
when the tree changes (a fork, free or prune: a new plan). A paged cache's tables keep their
buffers while the row count holds and the rows fit their headroom: its graph outlives such
changes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..runtime import upload, upload_into
from .cache import TreeCache
from .support import check_enabled, token_ids, vocab_size


class TreeDecoder:
    """Runs ``model`` over ``cache``'s rows. ``cuda_graphs``: None (on CUDA devices), True
    or False. True on CPU keeps the graph path's fixed buffers and replays by running the
    forward again (what tests use to check that path without a GPU)."""

    def __init__(self, model, cache: TreeCache, cuda_graphs: bool | None = None) -> None:
        check_enabled(model)
        if not isinstance(cache, TreeCache):
            raise TypeError(f"cache must be a TreeCache, got {type(cache).__name__}")
        self.model, self.cache = model, cache
        self.vocab = vocab_size(model)
        self.device = cache.allocator.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self._graph: StepGraph | None = None
        self._pool = torch.cuda.graph_pool_handle() if (self.cuda_graphs and
                                                         self.device.type == "cuda") else None
        self.captures = 0  # graphs captured so far (a test reads it)

    def extend(self, branch_id: int, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` to ``branch_id`` (one forward); returns the float32 logits of the
        next token. The batch becomes ``[branch_id]``."""
        tokens = token_ids("tokens", tokens, self.vocab).reshape(1, -1)
        if tokens.shape[1] == 0:
            raise ValueError("tokens must not be empty")
        self.cache.set_batch([branch_id])
        self.cache.begin_step(tokens.shape[1])
        positions = self._positions(tokens.shape[1])
        return run_step(self.model, self.cache, tokens.to(self.device), positions)[0]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row of the cache's batch (``tokens`` ``[rows]``); returns float32
        logits ``[rows, vocab]``. Tokens given on the host are checked against the vocabulary;
        tokens already on a GPU are not (that check would wait for the GPU every step)."""
        rows = len(self.cache.branch_ids)
        if not (isinstance(tokens, torch.Tensor) and tokens.is_cuda):
            tokens = token_ids("tokens", tokens, self.vocab)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if tokens.numel() != rows:
            raise ValueError(f"tokens must hold one token per row ({rows}), got "
                             f"{tokens.numel()}")
        if not self.cuda_graphs:
            self.cache.begin_step(1)
            return run_step(self.model, self.cache, tokens[:, None], self._positions(1))
        graph = self._graph
        if graph is None or graph.rows != rows:
            graph = self._graph = StepGraph(self.model, self.cache, rows, self._pool)
        key = self.cache.begin_step(1, graph.slots)
        if graph.key is not key:  # a new tree: run eagerly, capture on its next step
            graph.forget(key)
            return run_step(self.model, self.cache, tokens[:, None], self._positions(1))
        if not graph.captured:
            graph.capture()
            self.captures += 1
        return graph.replay(tokens, self.cache.step_starts)

    def _positions(self, new_tokens: int) -> torch.Tensor:
        starts = self.cache.step_starts
        return upload(starts[:, None] + np.arange(new_tokens), self.device)


def run_step(model, cache: TreeCache, input_ids: torch.Tensor,
             position_ids: torch.Tensor) -> torch.Tensor:
    """``model``'s forward over ``cache``'s open step: float32 logits of each row's last
    token. A forward that raises leaves no token."""
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
    except BaseException:
        cache.rollback()
        raise
    return out.logits[:, -1].float()


class StepGraph:
    """One decode step of ``rows`` rows captured with fixed input, position, slot and logits
    buffers, for the tree whose attention ``key`` (plan) it was captured with. It holds the
    model and cache, not the decoder: no cycle keeps a dropped decoder's graph (which may hold
    NCCL's communicator) alive until a garbage collection."""

    def __init__(self, model, cache: TreeCache, rows: int, pool) -> None:
        device = cache.allocator.device
        self.model, self.cache, self.rows, self.pool = model, cache, rows, pool
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.key = None
        self.graph = None
        self.logits: torch.Tensor | None = None
        self.captured = False

    def forget(self, key) -> None:
        """Drop the captured graph; ``key`` is the tree the next capture will be for."""
        self.key, self.graph, self.logits, self.captured = key, None, None, False

    def capture(self) -> None:
        """Record the step's forward (on CUDA: nothing runs; the replay runs it)."""
        if self.input_ids.is_cuda:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.logits = run_step(self.model, self.cache, self.input_ids, self.positions)
        self.captured = True

    def replay(self, tokens: torch.Tensor, starts) -> torch.Tensor:
        """The step for ``tokens`` at positions ``starts`` (the slots were copied into
        :attr:`slots` by ``begin_step``); returns a copy of the logits."""
        self.input_ids.copy_(tokens[:, None])
        upload_into(self.positions, starts)
        if self.graph is None:  # CPU: the same buffers, the forward run again
            return run_step(self.model, self.cache, self.input_ids, self.positions).clone()
        self.graph.replay()
        self.cache.complete_step()
        return self.logits.clone()
