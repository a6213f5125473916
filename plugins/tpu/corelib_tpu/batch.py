"""Batch state laid out for fixed XLA graphs.

The core's ``SamplingBatch`` writes rows with Python slices and grows its tensors as options
appear; on XLA each distinct slice or shape is a new graph. ``XlaSamplingBatch`` keeps the
same public behaviour with a layout that never changes shape:

- Per-row scalars (temperature, top-k, seeds, positions, ...) live on the host, in one float32
  and one int32 table of ``capacity`` rows; each step uploads the first ``bucket`` rows as one
  int32 block. Rows past the live ones hold neutral values.
- Dense per-row state lives on the device at full capacity from the start: one float32
  ``[C, V]`` additive row (allowed ids, one-token bad words and logit bias), the prompt mask and
  running output counts for penalties, the min-tokens stop mask, and fixed-width bad-word
  tables. Rows are written, moved and counted one graph each, with the row numbers passed as
  data (index tensors), so adding, removing and appending never compile anything new.

``capacity`` is the largest bucket. Limits that shape the graphs are set per sampler:
``max_bad_words`` words of two or more tokens per request, each at most
``max_bad_word_length`` tokens (one-token words are unlimited: they go into the additive row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from corelib.batch import SamplingBatch, StepState
from corelib.noise import split_seed
from corelib.params import SamplingParams

from . import xla
from .buckets import Buckets

NEG_INF = float("-inf")

FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")
NEUTRAL_FLOATS = (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)
INT_COLUMNS = ("top_k", "seed_lo", "seed_hi", "child", "position", "min_tokens", "seeded",
               "greedy", "random_key")
_COL = {name: i for i, name in enumerate(FLOAT_COLUMNS + INT_COLUMNS)}
_POSITION = INT_COLUMNS.index("position")
_RANDOM_KEY = INT_COLUMNS.index("random_key")

#: Static graph variants per bucket, chosen on the host from the rows' parameters (only random
#: rows count; greedy rows skip steps 10-13):
#: greedy = every row greedy (no filter, no draw); plain = no row uses top-k or top-p;
#: candidates = every top-k fits the candidate set and every top-p row has such a top-k
#: (steps 11-13 from one small topk); nucleus = some row uses top-p without top-k (top-p by
#: bisection over the vocabulary); exhaustive = some top-k exceeds the candidate set (top-k by
#: bisection too).
PATHS = ("greedy", "plain", "candidates", "nucleus", "exhaustive")

#: ``append`` marks rows that are not live with this id: their state is left untouched.
NOT_LIVE = -2


@dataclass
class XlaStepState(StepState):
    """``StepState`` plus the plugin's dense tensors and its static graph choice.

    Every tensor has ``num_rows`` = the bucket size as first dimension; padding rows hold
    neutral values (or stale dense state that no live row reads).
    """

    path: str = "plain"
    static_add: Optional[torch.Tensor] = None   # float32 [B, V]: 0, bias, or -inf
    stop_mask: Optional[torch.Tensor] = None    # bool [B, V]: stop ids and eos of min-tokens rows
    random_key: Optional[torch.Tensor] = None   # int32 [B]: unseeded rows' noise keys this step
    live_rows: int = 0                          # rows before the padding
    logprobs_asked: Optional[int] = None        # the batch's real N (num_logprobs is padded)


class XlaSamplingBatch(SamplingBatch):
    """A ``SamplingBatch`` whose per-step work is a fixed set of XLA graphs (module docstring).

    Created by ``TpuSampler.new_batch``; ``guard`` is the sampler's compile watch.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_id: Optional[int] = None, logprobs_mode: str = "raw", *,
                 buckets: Optional[Buckets] = None, top_k_candidates: int = 64,
                 max_bad_words: int = 8, max_bad_word_length: int = 8,
                 num_logprobs: int = 20, guard: Optional[xla.CompileGuard] = None):
        self.buckets = buckets if buckets is not None else Buckets()
        self.top_k_candidates = _positive("top_k_candidates", top_k_candidates)
        self.max_bad_words = _positive("max_bad_words", max_bad_words)
        self.max_bad_word_length = _positive("max_bad_word_length", max_bad_word_length)
        self.padded_logprobs = num_logprobs
        self.guard = guard if guard is not None else xla.CompileGuard()
        self._state: dict[str, torch.Tensor] = {}
        self._path: Optional[str] = None
        self._asked: Optional[tuple[Optional[int]]] = None
        self._sources: dict[tuple[int, bool], torch.Tensor] = {}
        super().__init__(vocab_size, device, eos_token_id, logprobs_mode)

    # ------------------------------------------------------------------ public additions
    @property
    def capacity(self) -> int:
        """Most rows this batch holds (the largest bucket)."""
        return self.buckets.largest

    def bucket(self, rows: Optional[int] = None) -> int:
        """The bucket a step of ``rows`` rows (default: the live rows) runs in."""
        return self.buckets.for_rows(max(1, self.num_rows if rows is None else rows))

    def path(self) -> str:
        """The static graph variant the current rows need (see ``PATHS``)."""
        if self._path is None:
            self._path = choose_path(self._row_params, self.top_k_candidates, self.vocab_size)
        return self._path

    def row_sources(self, bucket: int, per_request: bool) -> torch.Tensor:
        """int64 ``[bucket]`` host tensor: the logits row each batch row reads (its own row, or
        its request's row for per-request logits); padding rows read row 0."""
        key = (bucket, per_request)
        if key not in self._sources:
            if per_request:
                order = {rid: i for i, rid in enumerate(self.request_ids)}
                index = [order[rid] for rid, _ in self._row_keys]
            else:
                index = list(range(self.num_rows))
            index += [0] * (bucket - len(index))
            self._sources[key] = torch.tensor(index, dtype=torch.long)
        return self._sources[key]

    # ------------------------------------------------------------------ add / append
    def add(self, request_id: str, params: SamplingParams,
            prompt_token_ids: Sequence[int] = (),
            output_token_ids=None) -> list[int]:
        """As ``SamplingBatch.add``; also raises ValueError when the request needs more than
        the graphs were sized for (rows past the largest bucket, too many or too long
        multi-token bad words)."""
        if isinstance(params, SamplingParams):
            self._check_fits(request_id, params)
        return super().add(request_id, params, prompt_token_ids, output_token_ids)

    def append(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """Record one generated token per row (``[num_rows]`` ints).

        Host ids (a list or CPU tensor, as ``TpuSampler.sample`` returns) outside
        ``[0, vocab_size)`` raise, as in the core. Device ids are read back first (one
        transfer); there, out-of-range ids (the -1 of a flagged row) only advance the position.
        One graph per bucket updates the running counts and the recent-token window.
        """
        ids = self.check_token_ids(token_ids)   # the core's checks and messages
        n = ids.shape[0]
        if n == 0:
            return
        ids = ids.cpu().to(torch.long)
        out_of_range = (ids < 0) | (ids >= self.vocab_size)
        bucket = self.bucket(n)
        padded = torch.full((bucket,), NOT_LIVE, dtype=torch.long)
        padded[:n] = torch.where(out_of_range, -1, ids)
        self._record_tokens(padded)
        self._ints[:n, _POSITION] += 1
        for i in range(n):
            self._generated[i] += 1

    # ------------------------------------------------------------------ step state
    def step_state(self, num_rows: Optional[int] = None,
                   random_keys: Optional[torch.Tensor] = None) -> XlaStepState:
        """The first ``num_rows`` rows (default: the live rows; the sampler asks for its
        bucket, rows past the live ones being neutral padding) as device tensors.

        random_keys: int32 ``[num_rows]`` host tensor, the unseeded rows' noise keys for this
        step (the sampler draws them from its generator); zeros when omitted. One
        host-to-device transfer: the per-row scalars as an int32 ``[B, 15]`` block (floats as
        their bits). Dense state is sliced, not copied.
        """
        n = len(self._row_keys)
        B = n if num_rows is None else num_rows
        if B > self.capacity:
            raise ValueError(f"step_state needs num_rows <= {self.capacity}, got {B}")
        self._ints[:B, _RANDOM_KEY] = 0 if random_keys is None else random_keys
        host = torch.cat([self._floats[:B].view(torch.int32), self._ints[:B]], dim=1)
        table = host.to(self.device)
        col = lambda name: table[:, _COL[name]]                             # noqa: E731
        floats = xla.bitcast(table[:, :len(FLOAT_COLUMNS)], torch.float32)
        fcol = lambda name: floats[:, _COL[name]]                           # noqa: E731
        state = {name: tensor[:B] for name, tensor in self._state.items()}
        asked = self._asked_logprobs()
        path = self.path() if n else "greedy"
        return XlaStepState(
            num_rows=B, vocab_size=self.vocab_size, logprobs_mode=self.logprobs_mode,
            **{name: fcol(name) for name in FLOAT_COLUMNS},
            top_k=col("top_k"), seed_lo=col("seed_lo"), seed_hi=col("seed_hi"),
            child=col("child"), position=col("position"), min_tokens=col("min_tokens"),
            seeded=col("seeded") != 0, greedy=col("greedy") != 0, random_key=col("random_key"),
            prompt_mask=state["prompt_mask"], output_counts=state["output_counts"],
            bad_prefix=state["bad_prefix"], bad_last=state["bad_last"],
            bad_valid=state["bad_valid"], recent=state["recent"],
            static_add=state["static_add"], stop_mask=state["stop_mask"],
            path=path, live_rows=n, logprobs_asked=asked,
            **flags_for(path, asked, self.padded_logprobs),
        )

    def warm_state_graphs(self, rows: Sequence[int] = ()) -> None:
        """Compile the row-write, row-move and per-bucket append graphs without changing any
        live row: writes and moves target the last slot when it is free, appends mark every
        row not live."""
        free = self.capacity - 1
        if free >= self.num_rows:
            self._write_device_row(free, self._neutral_row())
            self._move_device_row(free, free)
        for bucket in self.buckets:
            self._record_tokens(torch.full((bucket,), NOT_LIVE, dtype=torch.long))

    # ------------------------------------------------------------------ core hooks
    def _changed(self) -> None:
        super()._changed()
        self._path = None
        self._asked = None
        self._sources = {}

    def _ensure_capacity(self, rows: int) -> None:
        """Allocate everything at full capacity once; ``add`` checks the row limit first."""
        if not self._state:
            self._allocate()

    def _allocate_optional_state(self, params: SamplingParams, prompt: list[int],
                                 outputs: list[list[int]]) -> None:
        """Nothing to allocate: every tensor exists at full size from the start."""

    def _write_rows(self, rows: list[int], params: SamplingParams, prompt: list[int],
                    outputs: list[list[int]]) -> None:
        shared = self._request_rows(params, prompt)
        for child, (row, out) in enumerate(zip(rows, outputs)):
            self._floats[row] = torch.tensor(_float_values(params))
            self._ints[row] = torch.tensor(_int_values(params, child, len(out), self.vocab_size),
                                           dtype=torch.int32)
            self._write_device_row(row, dict(shared, **self._child_rows(out)))

    def _move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._floats[dst] = self._floats[src]
        self._ints[dst] = self._ints[src]
        for s, d in zip(src.tolist(), dst.tolist()):
            self._move_device_row(s, d)

    def _reset_rows(self, rows: list[int]) -> None:
        """Freed rows become padding: neutral host scalars. Their dense device rows are stale
        but never read by a live row; the next request placed there overwrites them."""
        if rows:
            self._floats[rows] = torch.tensor(NEUTRAL_FLOATS)
            self._ints[rows] = 0

    # ------------------------------------------------------------------ internals
    def _allocate(self) -> None:
        C, V, dev = self.capacity, self.vocab_size, self.device
        W, P = self.max_bad_words, self._prefix_width
        self._floats = torch.tensor(NEUTRAL_FLOATS, dtype=torch.float32).repeat(C, 1)
        self._ints = torch.zeros((C, len(INT_COLUMNS)), dtype=torch.int32)
        self._state = {
            "static_add": torch.zeros((C, V), dtype=torch.float32, device=dev),
            "prompt_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "output_counts": torch.zeros((C, V), dtype=torch.int32, device=dev),
            "stop_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "bad_prefix": torch.full((C, W, P), -2, dtype=torch.long, device=dev),
            "bad_last": torch.zeros((C, W), dtype=torch.long, device=dev),
            "bad_valid": torch.zeros((C, W), dtype=torch.bool, device=dev),
            "recent": torch.full((C, P), -1, dtype=torch.long, device=dev),
        }
        with self.guard.watch("allocating a batch"):
            xla.launch(list(self._state.values()))

    @property
    def _prefix_width(self) -> int:
        return max(1, self.max_bad_word_length - 1)

    def _check_fits(self, request_id: str, params: SamplingParams) -> None:
        if self.num_rows + params.n > self.capacity:
            raise ValueError(
                f"request {request_id!r}: n={params.n} does not fit: this batch holds at most "
                f"{self.capacity} rows (the sampler's largest bucket), it has {self.num_rows}")
        multi = [w for w in params.bad_words if len(w) > 1]
        if len(multi) > self.max_bad_words:
            raise ValueError(
                f"request {request_id!r}: bad_words holds {len(multi)} words of two or more "
                f"tokens; the tpu backend was created with max_bad_words={self.max_bad_words}")
        longest = max((len(w) for w in multi), default=0)
        if longest > self.max_bad_word_length:
            raise ValueError(
                f"request {request_id!r}: bad_words holds a word of {longest} tokens; the tpu "
                f"backend was created with max_bad_word_length={self.max_bad_word_length}")

    def _request_rows(self, params: SamplingParams, prompt: list[int]) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows shared by a request's children: additive row, prompt mask,
        stop mask, bad-word tables."""
        V, W, P = self.vocab_size, self.max_bad_words, self._prefix_width
        add = torch.zeros(V, dtype=torch.float32)
        if params.allowed_token_ids is not None:
            add.fill_(NEG_INF)
            add[params.allowed_token_ids] = 0.0
        for word in params.bad_words:
            if len(word) == 1:
                add[word[0]] = NEG_INF
        for token, bias in params.logit_bias.items():
            add[token] += bias                     # -inf stays -inf: masks win over bias
        prompt_mask = torch.zeros(V, dtype=torch.bool)
        prompt_mask[prompt] = True
        stop = torch.zeros(V, dtype=torch.bool)
        if params.min_tokens > 0:
            stop[list(params.stop_token_ids)] = True
            if self.eos_token_id is not None:
                stop[self.eos_token_id] = True
        prefix = torch.full((W, P), -2, dtype=torch.long)
        last = torch.zeros(W, dtype=torch.long)
        valid = torch.zeros(W, dtype=torch.bool)
        for i, word in enumerate(w for w in params.bad_words if len(w) > 1):
            prefix[i, P - (len(word) - 1):] = torch.tensor(word[:-1], dtype=torch.long)
            last[i], valid[i] = word[-1], True
        rows = dict(static_add=add, prompt_mask=prompt_mask, stop_mask=stop, bad_prefix=prefix,
                    bad_last=last, bad_valid=valid)
        return {name: t[None] for name, t in rows.items()}

    def _child_rows(self, outputs: list[int]) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows of one child: output counts and recent-token window."""
        V, P = self.vocab_size, self._prefix_width
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=V).to(torch.int32)
        recent = torch.full((P,), -1, dtype=torch.long)
        tail = outputs[-P:]
        if tail:
            recent[P - len(tail):] = torch.tensor(tail, dtype=torch.long)
        return dict(output_counts=counts[None], recent=recent[None])

    def _neutral_row(self) -> dict[str, torch.Tensor]:
        rows = self._request_rows(SamplingParams(), [])
        rows.update(self._child_rows([]))
        return rows

    def _write_device_row(self, row: int, values: dict[str, torch.Tensor]) -> None:
        """Write one row of every dense tensor (one graph: the row number is data)."""
        index = torch.tensor([row], dtype=torch.long).to(self.device)
        for name, tensor in self._state.items():
            tensor.index_copy_(0, index, values[name].to(self.device))
        with self.guard.watch("writing a row (add)"):
            xla.launch(list(self._state.values()))

    def _move_device_row(self, src: int, dst: int) -> None:
        """Copy dense row ``src`` to row ``dst`` (one graph: both are data)."""
        pair = torch.tensor([src, dst], dtype=torch.long).to(self.device)
        for tensor in self._state.values():
            tensor.index_copy_(0, pair[1:], tensor.index_select(0, pair[:1]))
        with self.guard.watch("moving a row (remove)"):
            xla.launch(list(self._state.values()))

    def _record_tokens(self, padded: torch.Tensor) -> None:
        """Count ``padded`` (int64 ``[bucket]`` host ids; -1 = none, ``NOT_LIVE`` = leave the
        row alone) into the running counts and the recent window. One graph per bucket; the
        count update touches B entries, not the vocabulary."""
        B = padded.shape[0]
        ids = padded.to(self.device)
        live = ids != NOT_LIVE
        valid = (ids >= 0) & (ids < self.vocab_size)
        safe = torch.where(valid, ids, 0)
        counts, recent = self._state["output_counts"], self._state["recent"]
        rows = xla.iota(B, torch.int64, self.device)[0]
        counts.index_put_((rows, safe), valid.to(torch.int32), accumulate=True)
        window = recent[:B]
        shifted = torch.cat([window[:, 1:], torch.where(valid, ids, -1)[:, None]], dim=1)
        recent[:B] = torch.where(live[:, None], shifted, window)
        with self.guard.watch(f"append (bucket {B})"):
            xla.launch([counts, recent])

    def _asked_logprobs(self) -> Optional[int]:
        if self._asked is None:
            asked = [p.logprobs for p in self._row_params if p.logprobs is not None]
            self._asked = (max(asked) if asked else None,)
        return self._asked[0]


def choose_path(row_params: Sequence[SamplingParams], candidates: int,
                vocab_size: int = 2**31 - 1) -> str:
    """The static graph variant for these rows (``PATHS``). Greedy rows skip steps 10-13, so
    only random rows decide; a top-k of at least the vocabulary keeps everything (off)."""
    random = [p for p in row_params if not p.is_greedy]
    if not random:
        return "greedy"
    top_k = [_top_k(p, vocab_size) for p in random]
    filtering = [(p, k) for p, k in zip(random, top_k) if k > 0 or p.top_p < 1.0]
    if not filtering:
        return "plain"
    if any(k > candidates for _, k in filtering):
        return "exhaustive"
    if all(p.top_p >= 1.0 or k > 0 for p, k in filtering):
        return "candidates"
    return "nucleus"


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    """The top-k a row runs with: 0 (off) for greedy rows and for k >= the vocabulary."""
    k = params.effective_top_k
    return 0 if params.is_greedy or k >= vocab_size else k


def flags_for(path: str, asked: Optional[int], padded_logprobs: int) -> dict:
    """The core template's stage flags for a static variant: every stage runs (neutral values
    make it an identity for rows that do not use it) except what the variant leaves out.
    ``any_bias`` is False because the bias is part of the additive row of step 3.
    ``any_greedy`` is True only when every row is greedy: otherwise greedy rows, whose filter
    parameters are neutral, get their argmax from the draw (``TpuSampler.draw``)."""
    random = path != "greedy"
    filtering = path not in ("greedy", "plain")
    return dict(
        any_greedy=not random, all_greedy=not random, any_random=random, any_seeded=random,
        any_unseeded=random, any_top_k=filtering, any_top_p=filtering,
        any_min_p=random and path != "candidates",
        any_temperature=random, any_penalties=True, any_allowed=True, any_bias=False,
        any_min_tokens=True, any_bad_words=True,
        num_logprobs=None if asked is None else padded_logprobs,
    )


def _float_values(params: SamplingParams) -> list[float]:
    if params.is_greedy:   # steps 10-13 do not apply: neutral values keep the graphs' invariants
        return [1.0, 1.0, 0.0, params.repetition_penalty, params.frequency_penalty,
                params.presence_penalty]
    return [params.temperature, params.top_p, params.min_p, params.repetition_penalty,
            params.frequency_penalty, params.presence_penalty]


def _int_values(params: SamplingParams, child: int, position: int, vocab_size: int) -> list[int]:
    seed_lo, seed_hi = split_seed(params.seed) if params.seed is not None else (0, 0)
    # min_tokens past int32 means the same as 2**31 - 1: a position never reaches either.
    min_tokens = min(params.min_tokens, 2**31 - 1)
    return [_top_k(params, vocab_size), seed_lo, seed_hi, child, position, min_tokens,
            int(params.seed is not None), int(params.is_greedy), 0]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
