"""The step states a batch gives its sampler: ``step_state`` (the rows' tensors and host flags
for one ``sample``), ``speculative_state`` (``verify``'s and ``score``'s: a virtual row per slot,
each with the row's state advanced by the tokens before it), and the host flags computed when
requests join or leave. ``SamplingBatch`` mixes it in; the tensors are the row store's
(``batch_store``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import pipeline
from .params import ALL_LOGPROBS, SamplingParams
from .step_state import DENSE_ROW_STATE
from .step_state import STATE_FIELDS as _STATE_FIELDS
from .step_state import StepState


class RequestFlags(NamedTuple):
    """What one request's rows add to a step's host flags (``StepStates._compute_flags``),
    computed once when it joins: with one pass over these per join or leave, not several
    passes over every row's parameters."""
    greedy: bool
    seeded: bool
    thinking: bool
    selector: bool
    kept: bool
    logprobs: Optional[int]         # entries asked for (every token: vocab_size); None: none
    top_k: int                      # 0: off
    top_p_alone: bool               # top-p without top-k
    filter_order: Optional[tuple[str, ...]]

    @classmethod
    def of(cls, params: SamplingParams, vocab_size: int) -> "RequestFlags":
        greedy = params.is_greedy
        top_k = params.effective_top_k
        logprobs = params.logprobs
        return cls(
            greedy=greedy,
            seeded=params.seed is not None,
            thinking=params.uses_thinking_budget,
            selector=params.uses_mirostat or params.uses_adaptive_p,
            kept=params.return_kept,
            logprobs=vocab_size if logprobs == ALL_LOGPROBS else logprobs,
            top_k=top_k,
            top_p_alone=params.top_p < 1.0 and top_k == 0,
            filter_order=None if greedy else params.filter_order,
        )


class StepStates:
    """Step states of a batch's rows (mixed into ``SamplingBatch``, which provides the rows,
    their tensors and ``_advance``)."""

    def step_state(self, num_rows: Optional[int] = None) -> StepState:
        """The tensors and flags of the first ``num_rows`` rows (default: all rows).

        A backend that pads batches (TPU buckets) may ask for more rows than exist: rows past
        ``len(batch)`` hold neutral values (they exist up to the capacity, which grows to fit).
        """
        n = len(self._row_keys) if num_rows is None else num_rows
        if n > self._capacity:
            self._ensure_capacity(n)
        template = self._template
        if template is None or template.num_rows != n:
            template = self._template = self._new_step_state(n)
        # A new object each step (a backend may set attributes on it), sharing the template's
        # tensors (views of the batch's, which the steps update in place); only the flag that
        # moves with the positions is computed again.
        s = object.__new__(type(template))
        s.__dict__.update(template.__dict__)
        s.any_min_tokens = self._min_tokens_pending()
        return s

    def _new_step_state(self, n: int) -> StepState:
        """The step state of the first ``n`` rows, which ``step_state`` keeps (and copies for
        each step) until a request joins, leaves or moves, or a tensor is replaced. A subclass
        with state of its own extends it here, and calls ``_forget_views`` when it replaces a
        tensor the state holds a view of."""
        t, fields = self._row_views(n)
        return self._state_of(t, n, fields)

    def _row_views(self, n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(name -> the first ``n`` rows of every per-row tensor, the StepState fields among
        them): views, kept until a tensor is replaced or the batch's requests change."""
        views = self._views
        if views is None or views[0] != n:
            t = self._first_rows(n)
            fields = {name: v for name, v in t.items() if name in _STATE_FIELDS}
            views = self._views = (n, t, fields)
        return views[1], views[2]

    def _forget_views(self) -> None:
        """Drop the kept views and step state (a tensor was replaced, or the rows changed)."""
        self._views = None
        self._template = None

    def speculative_state(self, draft_token_ids: torch.Tensor,
                          num_rows: Optional[int] = None, dense_by_row: bool = False) -> StepState:
        """The step state of ``verify``: ``rows * (K + 1)`` virtual rows, row ``r``'s slot ``j``
        at ``r * (K + 1) + j``, each with the row's state as if its first ``j`` drafts had been
        appended (position, penalty counts, recent window for bad words and min_tokens, DRY
        history, custom stages' state).

        draft_token_ids: int64 ``[rows, K]`` on the batch's device, -1 = no draft (a suffix).
        ``num_rows``: as in ``step_state``, a padded row count (rows past ``len(batch)`` hold
        neutral values; ``draft_token_ids`` then has ``num_rows`` rows). The batch itself is not
        changed. Costs ``K + 1`` copies of the per-row state; with ``dense_by_row`` the
        ``[rows, V]`` tensors (``DENSE_ROW_STATE``) are not copied: the state holds the rows'
        own (views), ``slots_per_row`` K + 1 and ``slot_drafts``, each slot's earlier drafts,
        which the stages reading those tensors count on top (the reference's do)."""
        n = len(self._row_keys) if num_rows is None else num_rows
        if n > self._capacity:
            self._ensure_capacity(n)
        K = draft_token_ids.shape[1]
        S = K + 1
        store = self._tensors
        by_row = {name: store[name][:n] for name in DENSE_ROW_STATE if dense_by_row and name in store}
        # one index for every field: index_select costs half of repeat_interleave's calls
        slot_rows = torch.arange(n, device=self.device).repeat_interleave(S)        # (n*S,)
        t = {name: tensor[:n].index_select(0, slot_rows) for name, tensor in store.items()
             if name not in by_row}
        if "dry_history" in t and K:
            t["dry_history"] = _pad_columns(t["dry_history"], K, -1)
            t["dry_match"] = _pad_columns(t["dry_match"], K, 0)
        slot = torch.arange(S, device=self.device).repeat(n)                       # (n*S,)
        drafts = draft_token_ids.to(self.device, torch.long).index_select(0, slot_rows)
        columns = [(drafts[:, j], (slot > j) & (drafts[:, j] >= 0)) for j in range(K)]
        self._advance(t, columns)
        s = self._state_of({**t, **by_row}, n * S)
        s.verify_slots = S
        after = torch.full((drafts.shape[0], 1), -1, dtype=torch.long, device=self.device)
        s.verify_drafts = torch.cat([drafts, after], dim=1).gather(1, slot[:, None])[:, 0]
        if by_row:
            before = (slot[:, None] > torch.arange(K, device=self.device)[None, :]) & (drafts >= 0)
            s.slots_per_row, s.slot_drafts = S, torch.where(before, drafts, -1)
        return s

    def _state_of(self, t: dict[str, torch.Tensor], num_rows: int,
                  fields: Optional[dict[str, torch.Tensor]] = None) -> StepState:
        """A StepState over the row tensors ``t`` (the batch's rows, or expanded copies;
        ``fields``: the StepState fields among them, when the caller has them)."""
        if fields is None:
            fields = {name: tensor for name, tensor in t.items() if name in _STATE_FIELDS}
        return StepState(
            num_rows=num_rows,
            vocab_size=self.vocab_size,
            logprobs_mode=self.logprobs_mode,
            any_min_tokens=self._min_tokens_pending(),
            stages=self._stage_inputs(t),
            **self._host_flags(),
            **fields,
        )

    def _host_flags(self) -> dict:
        """The host flags of the batch's requests (``_compute_flags``), kept until a request
        joins or leaves."""
        if self._flags is None:
            self._flags = self._compute_flags()
        return self._flags

    def _compute_flags(self) -> dict:
        """Host flags that change only when requests join or leave: one pass over the
        requests' summaries (``RequestFlags``, made once per request at ``add``)."""
        requests = self._requests.values()
        flags = dict.fromkeys(pipeline.computed_flags(), False)
        flags.update(dict.fromkeys(frozenset().union(*(r.flags for r in requests)), True))
        rows = random = 0
        any_seeded = any_unseeded = any_thinking = any_selector = any_kept = False
        top_p_alone, all_top_k, max_top_k = False, True, 0
        num_logprobs, orders = None, set()
        for request in requests:
            r, n = request.summary, len(request.rows)
            rows += n
            any_thinking |= r.thinking
            any_kept |= r.kept
            if r.logprobs is not None:
                num_logprobs = r.logprobs if num_logprobs is None else max(num_logprobs, r.logprobs)
            if r.greedy:
                continue
            random += n
            any_seeded |= r.seeded
            any_unseeded |= not r.seeded
            any_selector |= r.selector
            top_p_alone |= r.top_p_alone
            all_top_k &= r.top_k > 0
            max_top_k = max(max_top_k, r.top_k)
            if r.filter_order is not None:
                orders.add(r.filter_order)
        return dict(
            **flags,
            any_greedy=random < rows,
            all_greedy=rows > 0 and random == 0,
            any_random=random > 0,
            any_seeded=any_seeded,
            any_unseeded=any_unseeded,
            any_thinking=any_thinking,
            any_selector=any_selector,
            any_kept=any_kept,
            filter_orders=self._filter_orders(orders),
            max_top_k=max_top_k,
            any_top_p_without_top_k=top_p_alone,
            all_random_top_k=random > 0 and all_top_k,
            num_logprobs=num_logprobs,
        )

    def _min_tokens_pending(self) -> bool:
        """Whether a row with min_tokens has generated fewer tokens than that (step 5 runs)."""
        rows = self._min_token_rows()
        if not rows:
            return False
        if self._stale_generated:
            if self.device.type != "cpu":
                return True     # positions only grow: a request that was pending may not be
            self._refresh_generated()
        generated, params = self._generated, self._row_params
        return any(generated[row] < params[row].min_tokens for row in rows)

    def _min_token_rows(self) -> list[int]:
        if self._min_rows is None:
            self._min_rows = [r for r, p in enumerate(self._row_params) if p.min_tokens > 0]
        return self._min_rows


def _pad_columns(x: torch.Tensor, extra: int, value) -> torch.Tensor:
    """x ``[n, C]`` with ``extra`` more columns of ``value`` on the right (new tensor)."""
    return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)], dim=1)
