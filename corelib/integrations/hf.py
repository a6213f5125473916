"""Hugging Face transformers causal LMs, sampled with corelib.

Two ways in, both with per-prompt ``SamplingParams`` (penalties, seeds, n completions, logprobs):

``generate(model, input_ids, params, max_new_tokens=...)``
    corelib's own decoding loop over the model's KV cache. Each prompt is run once; its
    n completions share the prompt's cache (it is copied to the children after the prefill),
    and a request leaves the batch (and the cache) as soon as all its children have stopped.

``CorelibLogitsProcessor(params)``
    for ``model.generate(..., logits_processor=[processor])``: corelib samples each step and
    the processor returns scores that allow only the sampled token, so transformers' own loop
    (streamers, stopping criteria, any cache) emits exactly corelib's choice.

transformers itself is never imported here: both paths only call the model (and the cache
object it returns), so this module works with any transformers version whose causal LMs take
``input_ids``, ``attention_mask``, ``position_ids`` and a cache, and import costs nothing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..params import SamplingParams
from ..sampler import Sampler, SamplerOutput

__all__ = ["Completion", "CorelibLogitsProcessor", "GenerateOutput", "TokenLogprobs", "generate"]

FINISH_STOP = "stop"      # an eos id or one of the request's stop_token_ids was generated
FINISH_LENGTH = "length"  # max_new_tokens reached


@dataclass
class TokenLogprobs:
    """One generated token's logprobs (step 15): the sampled token, its rank, the top-N."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first; N = params.logprobs


@dataclass
class Completion:
    """One completion: child ``child`` of prompt ``prompt_index``."""

    prompt_index: int
    child: int
    token_ids: list[int] = field(default_factory=list)   # generated tokens, the stop token included
    finish_reason: Optional[str] = None                  # "stop" or "length"
    logprobs: Optional[list[TokenLogprobs]] = None       # one per token when params.logprobs is set


@dataclass
class GenerateOutput:
    """What ``generate`` returns: ``completions[prompt][child]``."""

    completions: list[list[Completion]]
    prompt_ids: torch.Tensor   # int64 [P, T]: the prompts as the model saw them (left-padded)
    # With ``generate(return_kept=True)``, per completion (``rows`` order, C of them) and step
    # (S = the longest completion's length): int32 [C, S, ceil(V / 32)] packed kept sets
    # (``corelib.bitmask``), zeros from the step after a completion's last token on; float32
    # [C, S] the drawn token's logprob in the call's ``logprobs_mode``, 0 after the last token.
    kept: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    # With ``generate(return_logits=True)``: float32 [C, S, V] the logits the sampler was given
    # at each step (a prompt's one first-step row repeated for each of its children), 0 after
    # a completion's last token.
    logits: Optional[torch.Tensor] = None

    @property
    def rows(self) -> list[Completion]:
        """Every completion in (prompt, child) order, as transformers orders
        ``num_return_sequences`` rows."""
        return [c for children in self.completions for c in children]

    def token_ids(self) -> list[list[int]]:
        """Generated tokens per completion, in ``rows`` order."""
        return [c.token_ids for c in self.rows]

    def sequences(self, pad_token_id: int = 0) -> torch.Tensor:
        """int64 ``[P * n, T + longest]``: prompt and completion per row, right-padded with
        ``pad_token_id`` (the layout of transformers' ``generate`` output)."""
        rows = self.rows
        longest = max((len(c.token_ids) for c in rows), default=0)
        out = torch.full((len(rows), self.prompt_ids.shape[1] + longest), pad_token_id, dtype=torch.long)
        for i, c in enumerate(rows):
            out[i, : self.prompt_ids.shape[1]] = self.prompt_ids[c.prompt_index]
            out[i, self.prompt_ids.shape[1]: self.prompt_ids.shape[1] + len(c.token_ids)] = torch.tensor(
                c.token_ids, dtype=torch.long)
        return out

    def completion_ids(self) -> torch.Tensor:
        """int64 ``[C, S]``: each completion's generated tokens in ``rows`` order, -1 after its
        last token (``Sampler.score``'s padding), S the longest completion's length."""
        rows = self.rows
        longest = max((len(c.token_ids) for c in rows), default=0)
        out = torch.full((len(rows), longest), -1, dtype=torch.long)
        for i, c in enumerate(rows):
            out[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        return out


# ---------------------------------------------------------------------- inputs
def _left_padded(input_ids, attention_mask, pad_token_id: int):
    """(ids int64 [P, T], mask int64 [P, T], prompts list of token lists) from a tensor (with
    an optional left-padding mask) or from lists of token ids of any lengths."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an int tensor [prompts, tokens], got "
                             f"{input_ids.dtype} {list(input_ids.shape)}")
        ids = input_ids.to("cpu", torch.long)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to("cpu", torch.long)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {list(mask.shape)} differs from input_ids {list(ids.shape)}")
    else:
        lists = [list(p) for p in input_ids]
        width = max((len(p) for p in lists), default=0)
        ids = torch.full((len(lists), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(lists), width), dtype=torch.long)
        for i, p in enumerate(lists):
            if p:
                ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p):] = 1
    _check_left_padding(mask)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    return ids, mask, prompts


def _check_left_padding(mask: torch.Tensor) -> None:
    if mask.shape[0] == 0:
        raise ValueError("input_ids holds no prompt")
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: every prompt needs at least one token")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        row = int(((mask[:, 1:] < mask[:, :-1]).any(dim=1)).nonzero()[0, 0])
        raise ValueError(f"prompt {row} is not left-padded: decoder-only generation needs the "
                         f"padding (attention_mask 0) before the tokens")


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: one SamplingParams per prompt needed ({count}), got {len(params)}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be corelib.SamplingParams, got {type(p).__name__}")
    return params


def _eos_ids(model, eos_token_id) -> list[int]:
    """The stop ids: the argument, else the model's generation config (an int or a list)."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    return [eos_token_id] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def _pad_id(model, pad_token_id: Optional[int]) -> int:
    """The id written into padding (masked, so the model never reads it): the argument, else
    the model's generation config, else 0."""
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    return 0 if pad_token_id is None else int(pad_token_id)


def _with_extra_stops(params: SamplingParams, extra: Sequence[int]) -> SamplingParams:
    """min_tokens masks the batch's one eos id and the stop ids: further eos ids join the stops."""
    missing = [t for t in extra if t not in params.stop_token_ids]
    if not missing:
        return params
    return params.model_copy(update={"stop_token_ids": list(params.stop_token_ids) + missing})


def _check_vocabulary(model, prompts: list[list[int]]) -> None:
    """Prompt ids must fit the model's input embedding (the model would fail obscurely)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embeddings, "num_embeddings", None)
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if t < 0 or (size is not None and t >= size)]
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]}, out of range for the model's "
                             f"vocabulary of {size}")


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


# ---------------------------------------------------------------------- the model
class _ModelCall:
    """Calls a causal LM one step at a time, with the keyword names its forward accepts."""

    def __init__(self, model):
        self.model = model
        accepted = set(inspect.signature(model.forward).parameters)
        # transformers 5 renamed past_key_values to cache (the old name still works, with a warning).
        self.cache_name = "cache" if "cache" in accepted else "past_key_values"
        self.positions = "position_ids" in accepted
        keep = [k for k in ("logits_to_keep", "num_logits_to_keep") if k in accepted]
        self.keep_name = keep[0] if keep else None

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
        """tokens, mask, positions int64 ``[R, S]``, ``[R, L]``, ``[R, S]``. Returns the last
        position's logits ``[R, V]`` (the model's dtype) and the updated cache."""
        kwargs: dict[str, Any] = {"input_ids": tokens, "attention_mask": mask, "use_cache": True}
        if self.positions:
            kwargs["position_ids"] = positions
        if cache is not None:
            kwargs[self.cache_name] = cache
        if self.keep_name is not None:   # as transformers' generate: only the last logits
            kwargs[self.keep_name] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :], _cache_of(out)


def _cache_of(out):
    keys = out.keys() if hasattr(out, "keys") else ()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return out[name]
    raise ValueError("the model returned no cache: it must support use_cache=True")


def _select_rows(cache, index: torch.Tensor):
    """The cache with batch rows ``index`` (int64 [R], repeats allowed), in that order."""
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(index)
        return cache
    # The legacy format: a tuple per layer of (key, value) tensors [batch, heads, seq, dim].
    return tuple(tuple(t.index_select(0, index.to(t.device)) for t in layer) for layer in cache)


def _prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """int64 [P, T]: each token's position among its prompt's tokens (padding: 0), as
    transformers numbers them."""
    return (mask.cumsum(dim=-1) - 1).masked_fill(mask == 0, 0)


# ---------------------------------------------------------------------- generate
class _Decoding:
    """The host bookkeeping of one ``generate`` call: completions, stop sets, finished rows."""

    def __init__(self, params: list[SamplingParams], stops: list[set[int]],
                 per_step: Optional["_PerStep"] = None):
        self.params = params
        self.stops = stops
        self.completions = [[Completion(i, c, logprobs=[] if p.logprobs is not None else None)
                             for c in range(p.n)] for i, p in enumerate(params)]
        self.per_step = per_step

    def record(self, rows: list[tuple[str, int]], out: SamplerOutput, last_step: bool,
               logits: Optional[torch.Tensor] = None) -> list[str]:
        """Store one step's tokens (and, with ``per_step``, its tensors; logits float [R, V],
        one row per batch row); return the requests all of whose children have finished."""
        tokens = out.token_ids.tolist()
        logprobs = _host_logprobs(out)
        done, active = [], []
        for row, (rid, child) in enumerate(rows):
            prompt = int(rid)
            completion = self.completions[prompt][child]
            if completion.finish_reason is not None:
                continue   # a finished child keeps its row until its siblings finish
            active.append((row, prompt, child))
            completion.token_ids.append(tokens[row])
            if completion.logprobs is not None:
                completion.logprobs.append(_token_logprobs(logprobs, row, self.params[prompt].logprobs))
            if tokens[row] in self.stops[prompt]:
                completion.finish_reason = FINISH_STOP
            elif last_step:
                completion.finish_reason = FINISH_LENGTH
        for rid in dict.fromkeys(rid for rid, _ in rows):
            if all(c.finish_reason is not None for c in self.completions[int(rid)]):
                done.append(rid)
        if self.per_step is not None:
            self.per_step.record(active, out, logits)
        return done


class _PerStep:
    """``generate``'s per-step tensors (kept sets, drawn logprobs, logits), kept for each
    step's active rows and laid out ``[completions, steps, ...]`` at the end. Every completion
    draws its j-th token at step j, so a step's index is the same for all its rows."""

    def __init__(self, params: list[SamplingParams], kept: bool, logits: bool):
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.n)
        self.offsets, self.want_kept, self.want_logits = offsets, kept, logits
        self.steps: list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                               Optional[torch.Tensor], Optional[torch.Tensor]]] = []

    def record(self, active: list[tuple[int, int, int]], out: SamplerOutput,
               logits: Optional[torch.Tensor]) -> None:
        device = out.token_ids.device
        rows = torch.tensor([row for row, _, _ in active], dtype=torch.long, device=device)
        places = torch.tensor([self.offsets[p] + c for _, p, c in active], dtype=torch.long)
        kept = out.kept.index_select(0, rows) if self.want_kept else None
        drawn = out.logprobs.logprobs[:, 0].index_select(0, rows) if self.want_kept else None
        step_logits = None
        if self.want_logits:
            step_logits = logits.index_select(0, rows.to(logits.device)).float()
        self.steps.append((places, rows, kept, drawn, step_logits))

    def finish(self, output: "GenerateOutput", vocab_size: int) -> None:
        C, S = self.offsets[-1], len(self.steps)
        if self.want_kept:
            first = self.steps[0][2]
            output.kept = first.new_zeros((C, S, first.shape[-1]))
            output.logprobs = torch.zeros((C, S), dtype=torch.float32, device=first.device)
            for step, (places, _, kept, drawn, _) in enumerate(self.steps):
                output.kept[places.to(first.device), step] = kept
                output.logprobs[places.to(first.device), step] = drawn.float()
        if self.want_logits:
            first = self.steps[0][4]
            output.logits = first.new_zeros((C, S, vocab_size))
            for step, (places, _, _, _, logits) in enumerate(self.steps):
                output.logits[places.to(first.device), step] = logits


def _host_logprobs(out: SamplerOutput):
    if out.logprobs is None:
        return None
    lp = out.logprobs
    return lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()


def _token_logprobs(logprobs, row: int, n: int) -> TokenLogprobs:
    ids, values, ranks = logprobs
    end = len(ids[row]) if n == -1 else n + 1   # logprobs=-1: every token
    top = list(zip(ids[row][1: end], values[row][1: end]))
    return TokenLogprobs(ids[row][0], values[row][0], ranks[row], top)


def generate(model, input_ids, params: SamplingParams | Sequence[SamplingParams], *,
             max_new_tokens: int = 16, attention_mask: Optional[torch.Tensor] = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: Optional[int] = None,
             sampler: Optional[Sampler] = None, logprobs_mode: str = "raw",
             return_kept: bool = False, return_logits: bool = False) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens per completion with corelib sampling.

    ``model``: a transformers causal LM (any ``nn.Module`` whose forward takes ``input_ids``,
    ``attention_mask``, ``position_ids``, ``use_cache`` and a cache, and returns ``.logits``
    ``[R, S, V]`` and the cache). ``input_ids``: int tensor ``[P, T]`` (left-padded, with
    ``attention_mask``) or P lists of token ids of any lengths. ``params``: one
    ``SamplingParams`` for every prompt, or one per prompt; ``params.n`` completions each.

    A completion stops after an eos id (``eos_token_id``, default the model's generation
    config; ``[]`` never stops early) or one of its ``stop_token_ids``, never before
    ``min_tokens`` (the sampler masks them). ``sampler`` defaults to
    ``corelib.get_sampler(<the model's device>)``. List prompts are left-padded with
    ``pad_token_id`` (default: the model's generation config, else 0). Raises ValueError
    naming the request (its id is the prompt's index) when a row has no token left to sample
    (all masked) or its logits are NaN.

    For training on the rollout (``Sampler.score``; C completions in ``rows`` order, S the
    longest completion's length, V the vocabulary, W = ceil(V / 32)):

    - ``return_kept=True`` sets ``return_kept`` on every request's params (and ``logprobs``
      to 0 where it is None, so each drawn token's logprob is computed) and fills the output's
      ``kept``, int32 ``[C, S, W]``: each step's kept set, the tokens of the distribution the
      completion drew from (greedy rows: the argmax alone), packed as ``corelib.bitmask``
      packs the token bitmask; and ``logprobs``, float32 ``[C, S]``: the drawn token's
      logprob in ``logprobs_mode`` (``"processed"``: the value ``score`` reproduces). Both are
      zero after a completion's last token, where ``completion_ids()`` reads -1.
    - ``return_logits=True`` fills ``logits``, float32 ``[C, S, V]``: the logits the sampler
      was given at each step (a prompt's first-step row for each of its children), zero after
      a completion's last token. ``score(out.logits, batch, out.completion_ids(),
      kept=out.kept)`` on a batch holding the same requests then gives ``out.logprobs``
      bitwise (processed mode, the same backend).

    Neither changes a token: the draws are those of a call without them.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for name, value in (("return_kept", return_kept), ("return_logits", return_logits)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    device = _model_device(model)
    if sampler is None:
        from .. import get_sampler
        sampler = get_sampler(device)
    ids, mask, prompts = _left_padded(input_ids, attention_mask, _pad_id(model, pad_token_id))
    _check_vocabulary(model, prompts)
    params = _per_prompt(params, len(prompts))
    eos = _eos_ids(model, eos_token_id)
    params = [_with_extra_stops(p, eos[1:]) for p in params]
    if return_kept:
        params = [_with_kept(p) for p in params]
    per_step = _PerStep(params, return_kept, return_logits) if return_kept or return_logits else None
    decoding = _Decoding(params, [set(eos) | set(p.stop_token_ids) for p in params], per_step)
    call = _ModelCall(model)

    with torch.inference_mode():
        mask = mask.to(device)
        logits, cache = call(ids.to(device), mask, _prompt_positions(mask), None)   # [P, V]
        batch = sampler.new_batch(logits.shape[-1], eos_token_id=eos[0] if eos else None,
                                  logprobs_mode=logprobs_mode)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            batch.add(str(i), p, prompt_token_ids=prompt)
        # Children share their prompt's cache: copy each request's cache row to its rows.
        rows_to_prompt = batch.request_index().to(device)
        cache = _select_rows(cache, rows_to_prompt)
        mask = mask.index_select(0, rows_to_prompt)
        positions = mask.sum(dim=-1)                                         # next position, [R]
        for step in range(max_new_tokens):
            # First step: one logits row per prompt serves all its children (the contract's
            # per-request form); later steps: one row per completion.
            out = sampler.sample(logits.to(sampler.device), batch)
            out.raise_on_invalid(batch)   # names the request: its id is the prompt's index
            rows = batch.rows
            row_logits = None
            if return_logits:   # the first step's per-request logits, one row per child
                row_logits = logits.index_select(0, rows_to_prompt) if step == 0 else logits
            done = decoding.record(rows, out, last_step=step == max_new_tokens - 1, logits=row_logits)
            if step == max_new_tokens - 1 or len(done) == batch.num_requests:
                break
            batch.append(out.token_ids)
            tokens = out.token_ids.to(device)
            if done:
                keep = _remove_requests(batch, rows, done).to(device)
                cache, mask = _select_rows(cache, keep), mask.index_select(0, keep)
                positions, tokens = positions.index_select(0, keep), tokens.index_select(0, keep)
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits, cache = call(tokens[:, None], mask, positions[:, None], cache)
            positions = positions + 1
    output = GenerateOutput(decoding.completions, ids)
    if per_step is not None:
        per_step.finish(output, batch.vocab_size)
    return output


def _with_kept(params: SamplingParams) -> SamplingParams:
    """The request's params with its kept sets asked for, and the drawn token's logprob."""
    update: dict[str, Any] = {"return_kept": True}
    if params.logprobs is None:
        update["logprobs"] = 0
    return params.model_copy(update=update)


def _remove_requests(batch, old_rows: list[tuple[str, int]], done: list[str]) -> torch.Tensor:
    """Remove finished requests; int64 [R'] maps each remaining row to its old row (the
    batch moves its last rows into the holes, and the cache must follow)."""
    for rid in done:
        batch.remove(rid)
    old_place = {key: row for row, key in enumerate(old_rows)}
    return torch.tensor([old_place[key] for key in batch.rows], dtype=torch.long)


# ---------------------------------------------------------------------- logits processor
class CorelibLogitsProcessor:
    """A transformers logits processor that samples with corelib and forces the sampled token.

    ``model.generate(input_ids, logits_processor=[CorelibLogitsProcessor(params)],
    do_sample=False, max_new_tokens=...)``. The returned scores are 0 for the token corelib
    sampled and -inf elsewhere, so greedy decoding (or sampling, which then has one choice)
    emits it. ``params``: one ``SamplingParams`` for every prompt, or one per prompt. For
    ``n > 1`` pass ``do_sample=True, num_return_sequences=n`` (transformers rejects it with
    greedy decoding): its rows, prompt by prompt and child by child, are corelib's rows.

    Prompts are the input rows at the first call; with left padding give ``attention_mask``
    so padding tokens do not count as prompt tokens for repetition_penalty. A call whose
    input is not one token longer than the previous one starts a new generation. ``outputs``
    keeps each step's ``SamplerOutput`` (its logprobs, when asked for).
    """

    def __init__(self, params: SamplingParams | Sequence[SamplingParams], *,
                 sampler: Optional[Sampler] = None, eos_token_id: Optional[int] = None,
                 attention_mask: Optional[torch.Tensor] = None, logprobs_mode: str = "raw"):
        self.params = params
        self.sampler = sampler
        self.eos_token_id = eos_token_id
        self.attention_mask = attention_mask
        self.logprobs_mode = logprobs_mode
        self.batch = None
        self.outputs: list[SamplerOutput] = []
        self._length = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids int64 ``[R, L]``, scores float ``[R, V]`` -> float32 ``[R, V]`` that allow
        only the sampled token; ``scores`` is not modified."""
        if self.batch is None or input_ids.shape[1] != self._length + 1:
            self._start(input_ids, scores)
        else:
            self.batch.append(input_ids[:, -1])
        self._length = input_ids.shape[1]
        out = self.sampler.sample(scores.to(self.sampler.device), self.batch)
        out.raise_on_invalid(self.batch)
        self.outputs.append(out)
        token_ids = out.token_ids.to(scores.device)
        forced = torch.full(scores.shape, float("-inf"), dtype=torch.float32, device=scores.device)
        return forced.scatter_(1, token_ids[:, None], 0.0)

    def _start(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        if self.sampler is None:
            from .. import get_sampler
            self.sampler = get_sampler(scores.device)
        rows = input_ids.shape[0]
        params = self._params_for(rows)
        mask = self.attention_mask
        if mask is not None and mask.shape[0] == len(params) != rows:
            # one mask row per prompt: expand it as num_return_sequences expands the input
            mask = mask.repeat_interleave(torch.tensor([p.n for p in params]), dim=0)
        batch = self.sampler.new_batch(scores.shape[-1], eos_token_id=self.eos_token_id,
                                       logprobs_mode=self.logprobs_mode)
        row = 0
        for i, p in enumerate(params):
            prompt = input_ids[row]
            if mask is not None:
                prompt = prompt[mask[row].to(prompt.device).bool()]
            batch.add(str(i), p, prompt_token_ids=prompt.tolist())
            row += p.n
        self.batch, self.outputs = batch, []

    def _params_for(self, rows: int) -> list[SamplingParams]:
        if isinstance(self.params, SamplingParams):
            if rows % self.params.n:
                raise ValueError(f"{rows} input rows are not a multiple of n={self.params.n}")
            return [self.params] * (rows // self.params.n)
        params = _per_prompt(self.params, len(self.params))
        if sum(p.n for p in params) != rows:
            raise ValueError(f"the input has {rows} rows but params ask for "
                             f"{sum(p.n for p in params)} (the sum of n over prompts)")
        return params
