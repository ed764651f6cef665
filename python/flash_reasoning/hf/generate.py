"""Reasoning-style generation over a :class:`TreeCache`: every mode prefills its prompt once
and grows a tree of branches by allocator operations (fork, free, prune), never by copying
K/V.

- :func:`sample`: ``n`` continuations of one prompt (parallel sampling, self-consistency).
- :func:`beam_search`: ``num_beams`` beams, forked and freed each step; the algorithm of
  transformers' ``generate(num_beams=...)`` (same length penalty and early stopping).
- :class:`ThoughtTree`: expand a node into children with their own continuation prompts,
  generate from leaves, score, prune (tree of thought).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..ops.checks import as_int
from .cache import TreeCache
from .decoder import TreeDecoder
from .support import check_enabled, eos_ids, token_ids, vocab_size

#: Default KV block size (tokens) of the caches these functions make.
BLOCK_SIZE = 16


@dataclass
class Sampling:
    """How the next token is chosen: greedy (``do_sample=False``) or sampled after
    transformers' temperature, top-k and top-p warpers."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:  # refused here, not in the middle of a generation
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or
                                       not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be None or lie in (0, 1], got {self.top_p}")

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` ``[rows, vocab]``."""
        if not self.do_sample:
            return logits.argmax(-1)
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        scores = warpers(None, logits.clone())
        probs = torch.softmax(scores, dim=-1)
        generator = self.generator
        if generator is not None and generator.device != probs.device:
            probs = probs.to(generator.device)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


@dataclass
class SampleOutput:
    """``tokens`` ``[n, steps]``, ``steps <= max_new_tokens`` (fewer once every row ended;
    after a row's EOS: ``pad_token_id``), ``lengths`` the tokens of each up to and including
    its EOS, ``branch_ids`` their branches in ``cache`` (holding every token but each one's
    last); with ``return_logits``, ``logits`` ``[n, steps, vocab]``: the float32 logits each
    token was chosen from."""
    tokens: torch.Tensor
    lengths: list[int]
    branch_ids: list[int]
    cache: TreeCache = field(repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)


def sample(model, prompt: Sequence[int] | torch.Tensor, n: int, max_new_tokens: int, *,
           sampling: Sampling | None = None, first_tokens: Sequence[int] | None = None,
           eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
           cache: TreeCache | None = None, cuda_graphs: bool | None = None,
           share_prompt: bool = True, return_logits: bool = False) -> SampleOutput:
    """``n`` continuations of ``prompt`` (prefilled once, then forked ``n`` times), each up
    to ``max_new_tokens`` tokens. ``first_tokens`` forces each continuation's first token
    (``n`` of them). ``share_prompt=False`` gives each continuation its own copy of the
    prompt's K/V (the no-sharing baseline; pair it with ``TreeCache(attention="paged")``)."""
    check_enabled(model)
    prompt = _prompt(model, prompt)
    n = as_int("n", n, low=1)
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, low=1)
    sampling = sampling or Sampling()
    eos, pad_token_id = _stop_tokens(model, eos_token_id, pad_token_id)
    if first_tokens is not None:
        first_tokens = token_ids("first_tokens", first_tokens, vocab_size(model))
        if first_tokens.numel() != n:
            raise ValueError(f"first_tokens must hold n={n} tokens, got {first_tokens.numel()}")
    if cache is None:
        copies = 0 if share_prompt else n
        cache = TreeCache(model, blocks_for(prompt.numel(), n, max_new_tokens, copies),
                          BLOCK_SIZE)
    decoder = TreeDecoder(model, cache, cuda_graphs)
    with _new_branches_freed(cache):
        return _sample(decoder, prompt, n, max_new_tokens, sampling, first_tokens, eos,
                       pad_token_id, share_prompt, return_logits)


def _sample(decoder, prompt, n, max_new_tokens, sampling, first_tokens, eos, pad_token_id,
            share_prompt, return_logits) -> SampleOutput:
    cache = decoder.cache
    root = cache.new_branch()
    logits = decoder.extend(root, prompt)
    if first_tokens is not None:
        tokens = first_tokens.to(logits.device)
    else:
        tokens = sampling.choose(logits.expand(n, -1))
    branches = cache.fork(root, n, share=share_prompt)
    cache.free(root)
    cache.set_batch(branches)
    stop = _Stops(eos, pad_token_id, n, tokens.device)
    out = [stop.record(tokens)]
    seen = [logits.expand(n, -1)] if return_logits else None
    for _ in range(max_new_tokens - 1):
        if stop.all_done():
            break
        logits = decoder.decode(tokens)
        if return_logits:
            seen.append(logits)
        tokens = sampling.choose(logits)
        out.append(stop.record(tokens))
    return SampleOutput(torch.stack(out, dim=1), stop.lengths(len(out)), branches, cache,
                        torch.stack(seen, dim=1) if return_logits else None)


@dataclass
class BeamSearchOutput:
    """``sequences`` ``[num_return_sequences, generated]`` (the prompt left out; padded
    after EOS) and their length-penalised ``scores``, best first."""
    sequences: torch.Tensor
    scores: torch.Tensor


def beam_search(model, prompt: Sequence[int] | torch.Tensor, num_beams: int,
                max_new_tokens: int, *, eos_token_id: int | Sequence[int] | None = None,
                pad_token_id: int | None = None, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_return_sequences: int = 1,
                cache: TreeCache | None = None, cuda_graphs: bool | None = None
                ) -> BeamSearchOutput:
    """Beam search as transformers' ``generate(num_beams=...)`` does it for one prompt (the
    top ``max(2, 1 + #eos) * num_beams`` candidates each step, finished hypotheses kept by
    score / length ** ``length_penalty``, its ``early_stopping`` heuristics), with the
    prompt prefilled once and each step's beams made by forking and freeing branches. It frees
    its branches when it returns: a ``cache`` passed in holds what it held before.

    The beams' tree changes almost every step, and a tree plan made anew runs eagerly, so the
    cache it makes reads each beam's path with ``attention="paged"`` (storage still shared),
    whose decode steps replay one CUDA graph (captured again only when the beams outgrow
    their tables' headroom); pass a ``TreeCache(..., attention="tree")`` to read the shared
    prompt once per step instead (an eager step after each reshuffle)."""
    check_enabled(model)
    prompt = _prompt(model, prompt)
    k = as_int("num_beams", num_beams, low=1)
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, low=1)
    if not 1 <= num_return_sequences <= k:
        raise ValueError(f"num_return_sequences must lie in [1, {k}], got {num_return_sequences}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    eos, pad_token_id = _stop_tokens(model, eos_token_id, pad_token_id)
    if cache is None:
        cache = TreeCache(model, blocks_for(prompt.numel(), k, max_new_tokens), BLOCK_SIZE,
                          attention="paged")
    decoder = TreeDecoder(model, cache, cuda_graphs)
    with _new_branches_freed(cache, on_success=True):  # the output names no branch
        return _beam_search(decoder, prompt, k, max_new_tokens, eos, pad_token_id,
                            length_penalty, early_stopping, num_return_sequences)


def _beam_search(decoder, prompt, k, max_new_tokens, eos, pad_token_id,
                 length_penalty, early_stopping, num_return_sequences) -> BeamSearchOutput:
    cache = decoder.cache
    root = cache.new_branch()
    logits = decoder.extend(root, prompt)[None].expand(k, -1)  # the k beams start alike
    state = _BeamState(prompt.to(logits.device), k, max_new_tokens, eos, pad_token_id,
                       length_penalty, early_stopping)
    first = True
    while True:
        sources = state.step(torch.log_softmax(logits, dim=-1))
        if state.done:
            break
        # The first step's beams all come from the prompt's one branch.
        cache.regroup([0] * k if first else sources.tolist())
        first = False
        logits = decoder.decode(state.last_tokens())
    return state.result(num_return_sequences)


class _BeamState:
    """transformers' beam search state for one prompt (its ``_beam_search`` with a batch of
    one), the cache left to the caller: :meth:`step` returns each new running beam's source
    beam."""

    def __init__(self, prompt, k, max_new_tokens, eos, pad_token_id, length_penalty,
                 early_stopping) -> None:
        device = prompt.device
        self.k, self.prompt_len = k, prompt.numel()
        self.max_length = self.prompt_len + max_new_tokens
        self.cur_len = self.prompt_len
        self.eos = None if eos is None else eos.to(device)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + (0 if self.eos is None else self.eos.numel())) * k
        self.top_mask = torch.arange(self.keep, device=device) < k
        # transformers' fill: -1 without EOS, else the pad token unless it is None or 0.
        fill = -1 if self.eos is None else (pad_token_id or int(self.eos[0]))
        self.running = torch.full((k, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :self.prompt_len] = prompt
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros(k, device=device)
        self.running_scores[1:] = -1e9
        self.scores = torch.full((k,), -1e9, device=device)
        self.finished = torch.zeros(k, dtype=torch.bool, device=device)
        self.improvable = torch.ones((), dtype=torch.bool, device=device)
        self.running_sources = torch.full((k, max_new_tokens), -1, dtype=torch.long,
                                          device=device)
        self.sources = self.running_sources.clone()
        self.done = False

    def step(self, log_probs: torch.Tensor) -> torch.Tensor:
        """Take one step from ``log_probs`` ``[k, vocab]`` of the running beams."""
        vocab = log_probs.shape[-1]
        total = (log_probs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(total, self.keep)
        beam, token = top_index // vocab, top_index % vocab
        cand_seqs = self.running[beam].clone()
        cand_seqs[:, self.cur_len] = token
        cand_sources = self.running_sources[beam].clone()
        cand_sources[:, self.cur_len - self.prompt_len] = beam
        hits = self._stops(token)
        # The best unfinished candidates run on.
        alive_scores = top_scores + hits.float() * -1e9
        pick = torch.topk(alive_scores, self.k)[1]
        self.running, self.running_scores = cand_seqs[pick], alive_scores[pick]
        self.running_sources = cand_sources[pick]
        self._update_finished(cand_seqs, top_scores, cand_sources, hits)
        self.cur_len += 1
        self._update_improvable()
        self.done = not (bool(self.improvable)
                         and not (bool(self.finished.all()) and self.early_stopping is True)
                         and not bool(hits.all()))
        return self.running_sources[:, self.cur_len - 1 - self.prompt_len]

    def last_tokens(self) -> torch.Tensor:
        return self.running[:, self.cur_len - 1]

    def result(self, num_return: int) -> BeamSearchOutput:
        sources = self.sources[:num_return]
        generated = int((sources >= 0).sum(dim=1).max())
        sequences = self.sequences[:num_return, self.prompt_len:self.prompt_len + generated]
        return BeamSearchOutput(sequences, self.scores[:num_return])

    def _stops(self, token: torch.Tensor) -> torch.Tensor:
        hits = torch.full_like(token, self.cur_len + 1 >= self.max_length, dtype=torch.bool)
        if self.eos is not None:
            hits |= torch.isin(token, self.eos)
        return hits

    def _update_finished(self, cand_seqs, top_scores, cand_sources, hits) -> None:
        just_finished = hits & self.top_mask
        scores = top_scores / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = bool(self.finished.all()) and self.early_stopping is True
        scores = scores + float(full) * -1e9 + (~self.improvable).float() * -1e9
        scores = scores + (~just_finished).float() * -1e9
        merged_scores = torch.cat([self.scores, scores])
        pick = torch.topk(merged_scores, self.k)[1]
        self.sequences = torch.cat([self.sequences, cand_seqs])[pick]
        self.scores = merged_scores[pick]
        self.sources = torch.cat([self.sources, cand_sources])[pick]
        self.finished = torch.cat([self.finished, just_finished])[pick]

    def _update_improvable(self) -> None:
        """Whether a running beam can still beat the worst finished one (transformers'
        ``_check_early_stop_heuristic``)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best_running = self.running_scores[0] / (best_length ** self.length_penalty)
        worst_finished = torch.where(self.finished, self.scores.min(),
                                     torch.tensor(-1.0e9, device=self.scores.device))
        self.improvable = self.improvable & (best_running > worst_finished).any()


class ThoughtNode:
    """A node of a :class:`ThoughtTree`: its own ``tokens`` (a continuation prompt, then what
    was generated from it), a ``score`` to set, its ``children``. It refers to its tree and
    parent weakly (links point down only): a dropped tree frees its cache at once, not at the
    next garbage collection."""

    def __init__(self, tree: ThoughtTree, branch_id: int, parent: ThoughtNode | None,
                 tokens: list[int]) -> None:
        self._tree = weakref.ref(tree)
        self._parent = None if parent is None else weakref.ref(parent)
        self.branch_id = branch_id
        self.tokens = tokens
        self.children: list[ThoughtNode] = []
        self.score: float | None = None
        self.finished = False  # generated an EOS
        self.alive = True
        # The next token comes from next_logits (every token is in the branch), or the last
        # generated token is pending (not yet in the branch: it is fed first).
        self.next_logits: torch.Tensor | None = None
        self.pending: int | None = None

    @property
    def tree(self) -> ThoughtTree | None:
        """The tree this node belongs to (None once the tree is dropped)."""
        return self._tree()

    @property
    def parent(self) -> ThoughtNode | None:
        """The node this one continues (None for the root, or once the tree is dropped)."""
        return None if self._parent is None else self._parent()

    def path_tokens(self) -> list[int]:
        """The prompt and every token on the way to this node, its own included."""
        node, parts = self, []
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def __repr__(self) -> str:
        return (f"ThoughtNode(branch_id={self.branch_id}, tokens={len(self.tokens)}, "
                f"children={len(self.children)}, score={self.score}, alive={self.alive})")


class ThoughtTree:
    """A tree of thought over one prompt: the root holds the prompt (prefilled once); every
    node is a branch forked from its parent's, so a path's tokens are stored once however
    many nodes continue it. ``max_tokens`` sizes the cache when none is given (the tokens
    stored at once, shared ones counted once)."""

    def __init__(self, model, prompt: Sequence[int] | torch.Tensor, *, max_tokens: int = 32768,
                 cache: TreeCache | None = None, cuda_graphs: bool | None = None,
                 block_size: int = BLOCK_SIZE) -> None:
        check_enabled(model)
        prompt = _prompt(model, prompt)
        self.cache = cache or TreeCache(model, -(-max_tokens // block_size) + 2, block_size)
        self.decoder = TreeDecoder(model, self.cache, cuda_graphs)
        self.root = ThoughtNode(self, self.cache.new_branch(), None, prompt.tolist())
        self.root.next_logits = self.decoder.extend(self.root.branch_id, prompt)

    def expand(self, node: ThoughtNode,
               continuations: Sequence[Sequence[int]]) -> list[ThoughtNode]:
        """A child of ``node`` per continuation prompt (may be empty), each forked from
        ``node``'s branch and extended by its prompt (one forward per child)."""
        self._check_alive(node)
        prompts = [token_ids("a continuation", c, self.decoder.vocab).tolist()
                   for c in continuations]
        children = []
        with _new_branches_freed(self.cache):  # all children, or none
            for tokens in prompts:
                child = ThoughtNode(self, self.cache.fork(node.branch_id, 1)[0], node, tokens)
                fed = ([node.pending] if node.pending is not None else []) + tokens
                child.next_logits = (self.decoder.extend(child.branch_id, fed) if fed
                                     else node.next_logits)
                children.append(child)
        node.children += children
        return children

    def generate(self, nodes: Sequence[ThoughtNode], max_new_tokens: int, *,
                 sampling: Sampling | None = None,
                 eos_token_id: int | Sequence[int] | None = None) -> list[list[int]]:
        """Continue each leaf of ``nodes`` together (one decode step for all per token) by up
        to ``max_new_tokens`` tokens, stopping each at EOS; the tokens join each node's own.
        Returns what each generated."""
        nodes = list(nodes)
        if not nodes:
            raise ValueError("nodes must name at least one leaf")
        max_new_tokens = as_int("max_new_tokens", max_new_tokens, low=1)
        for node in nodes:
            self._check_alive(node)
            if node.children:
                raise ValueError(f"{node} has children: generate only from leaves (expand "
                                 f"with an empty continuation to branch off it)")
            if node.finished:
                raise ValueError(f"{node} already ended with an EOS")
        sampling = sampling or Sampling()
        eos = eos_ids(eos_token_id, self.decoder.vocab)
        lengths = [self.cache.length(node.branch_id) for node in nodes]
        try:
            return self._generate(nodes, max_new_tokens, sampling, eos)
        except BaseException:  # all or nothing: the branches lose what this call wrote
            for node, length in zip(nodes, lengths):
                self.cache.truncate(node.branch_id, length)
            raise

    def _generate(self, nodes, max_new_tokens, sampling, eos) -> list[list[int]]:
        self.cache.set_batch([node.branch_id for node in nodes])
        device = self.cache.allocator.device
        tokens, to_choose = torch.zeros(len(nodes), dtype=torch.long, device=device), []
        for i, node in enumerate(nodes):
            if node.pending is not None:
                tokens[i] = node.pending
            else:
                to_choose.append(i)
        stop = _Stops(eos, None, len(nodes), device)
        generated = []
        if to_choose:  # nodes whose next token comes from their logits: choose it first
            chosen = sampling.choose(torch.stack([nodes[i].next_logits for i in to_choose]))
            tokens[to_choose] = chosen
        if len(to_choose) != len(nodes):
            # Nodes with a pending token feed it first: everyone decodes once, the others'
            # chosen tokens wait for the next step.
            tokens = self._feed_pending(nodes, tokens, to_choose, sampling)
        generated.append(stop.record(tokens))
        for _ in range(max_new_tokens - 1):
            if stop.all_done():
                break
            tokens = sampling.choose(self.decoder.decode(tokens))
            generated.append(stop.record(tokens))
        return self._settle(nodes, torch.stack(generated, dim=1), stop)

    def prune(self, node: ThoughtNode) -> None:
        """Free ``node``'s branch and its whole subtree."""
        self._check_alive(node)
        if node is self.root:
            raise ValueError("the root cannot be pruned")
        self.cache.prune(node.branch_id)
        node.parent.children.remove(node)
        stack = [node]
        while stack:
            dead = stack.pop()
            dead.alive = False
            stack.extend(dead.children)

    def leaves(self) -> list[ThoughtNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node) if not node.children else stack.extend(reversed(node.children))
        return out

    def best(self, k: int = 1) -> list[ThoughtNode]:
        """The ``k`` scored leaves with the highest scores."""
        scored = [node for node in self.leaves() if node.score is not None]
        return sorted(scored, key=lambda node: node.score, reverse=True)[:k]

    def _feed_pending(self, nodes, tokens, to_choose, sampling) -> torch.Tensor:
        """Rows with a pending token decode it, rows whose token was just chosen from their
        logits wait: run only the pending rows, then all rows go on together."""
        chosen = set(to_choose)
        pending_rows = [i for i in range(len(nodes)) if i not in chosen]
        self.cache.set_batch([nodes[i].branch_id for i in pending_rows])
        logits = self.decoder.decode(tokens[pending_rows])
        tokens = tokens.clone()
        tokens[pending_rows] = sampling.choose(logits)
        self.cache.set_batch([node.branch_id for node in nodes])
        return tokens

    def _settle(self, nodes, generated: torch.Tensor, stop: _Stops) -> list[list[int]]:
        lengths = stop.lengths(generated.shape[1])
        out = []
        for node, row, length, done in zip(nodes, generated.tolist(), lengths, stop.finished):
            new = row[:length]
            node.tokens += new
            node.pending, node.next_logits = new[-1], None
            node.finished = bool(done)
            out.append(new)
        return out

    def _check_alive(self, node: ThoughtNode) -> None:
        if node.tree is not self or not node.alive:
            raise ValueError(f"{node} is not a live node of this tree")


class _Stops:
    """Which rows have generated an EOS, and the pad tokens they emit after it."""

    def __init__(self, eos: torch.Tensor | None, pad_token_id, rows: int, device) -> None:
        self.eos = None if eos is None else eos.to(device)
        pad = pad_token_id if pad_token_id is not None else (
            int(self.eos[0]) if self.eos is not None else 0)
        self.pad = torch.tensor(pad, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        # The step count at each row's EOS (0: none yet), kept on the device: recording a step
        # never waits for the GPU (all_done, once a step, is the loop's one sync).
        self.ended_at = torch.zeros(rows, dtype=torch.long, device=device)
        self.steps = 0

    def record(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` with rows that ended before padded; marks rows ending now."""
        out = torch.where(self.done, self.pad, tokens)
        self.steps += 1
        if self.eos is not None:
            ending = torch.isin(tokens, self.eos) & ~self.done
            self.ended_at.masked_fill_(ending, self.steps)
            self.done |= ending
        return out

    def all_done(self) -> bool:
        return self.eos is not None and bool(self.done.all())

    @property
    def finished(self) -> list[bool]:
        return self.done.tolist()

    def lengths(self, steps: int) -> list[int]:
        return torch.where(self.done, self.ended_at, steps).tolist()


def blocks_for(prompt_tokens: int, branches: int, new_tokens: int, copies: int = 0,
               slack_per_branch: int = 1, block_size: int = BLOCK_SIZE) -> int:
    """Blocks a cache needs for a prompt shared by ``branches`` continuations of
    ``new_tokens`` each (plus ``copies`` full copies of the prompt): each branch's blocks,
    one more where its first write copies the shared partial block, the reserved block."""
    per_branch = math.ceil(new_tokens / block_size) + 1 + slack_per_branch
    prompt_blocks = math.ceil(prompt_tokens / block_size)
    return prompt_blocks * (1 + copies) + branches * per_branch + 1


@contextmanager
def _new_branches_freed(cache: TreeCache, *, on_success: bool = False):
    """On an exception (and with ``on_success`` on return too), free every branch made inside:
    a cache the caller passed keeps only the branches it held before the call."""
    before = set(cache.allocator.live_branch_ids())

    def free_new():
        for branch_id in sorted(set(cache.allocator.live_branch_ids()) - before):
            cache.free(branch_id)
    try:
        yield
    except BaseException:
        free_new()
        raise
    if on_success:
        free_new()


def _stop_tokens(model, eos_token_id, pad_token_id) -> tuple[torch.Tensor | None, int | None]:
    """The EOS ids (checked against the vocabulary) and the pad id (an int), or None each."""
    pad = None if pad_token_id is None else as_int("pad_token_id", pad_token_id)
    return eos_ids(eos_token_id, vocab_size(model)), pad


def _prompt(model, prompt) -> torch.Tensor:
    tokens = token_ids("the prompt", prompt, vocab_size(model))
    if tokens.numel() == 0:
        raise ValueError("the prompt must hold at least one token")
    return tokens
