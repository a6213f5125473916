"""The device side of the TPU batch's rows: allocating its dense per-row state at full
capacity, checking that a request fits the graphs' fixed sizes, the values a request's rows
start from, and writing and moving rows with the row numbers as data (one graph each).
``XlaSamplingBatch`` (``batch``) mixes it in.
"""

from __future__ import annotations

from typing import Sequence

import torch
from corelib import thinking
from corelib.batch import _stage_key
from corelib.params import ALL_LOGPROBS, SamplingParams
from corelib.stages import StageError, StageSpec, describe_stage

from . import dry, xla
from .layout import _INT32_MAX, _THINKING_BUDGET, INT_COLUMNS, NEUTRAL_FLOATS, STATE_FIELDS

NEG_INF = float("-inf")


class DeviceRows:
    """Allocation, fit checks and row writes of ``XlaSamplingBatch`` (which provides the
    sizes, the host tables and ``_state``)."""

    def _allocate(self) -> None:
        C, V, dev = self.capacity, self.vocab_size, self.device
        W, P, H = self.max_bad_words, self._prefix_width, self.dry_window
        L = self.max_thinking_marker_length
        self._floats = torch.tensor(NEUTRAL_FLOATS, dtype=torch.float32).repeat(C, 1)
        self._ints = torch.zeros((C, len(INT_COLUMNS)), dtype=torch.int32)
        self._ints[:, _THINKING_BUDGET] = thinking.NO_BUDGET
        self._state = {
            "static_add": torch.zeros((C, V), dtype=torch.float32, device=dev),
            "prompt_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "output_counts": torch.zeros((C, V), dtype=torch.int32, device=dev),
            "stop_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "bad_prefix": torch.full((C, W, P), -2, dtype=torch.long, device=dev),
            "bad_last": torch.zeros((C, W), dtype=torch.long, device=dev),
            "bad_valid": torch.zeros((C, W), dtype=torch.bool, device=dev),
            "recent": torch.full((C, P), -1, dtype=torch.long, device=dev),
            "dry_history": torch.full((C, H), dry.EMPTY, dtype=torch.int32, device=dev),
            "dry_match": torch.zeros((C, H), dtype=torch.int32, device=dev),
            "dry_since": torch.zeros(C, dtype=torch.int32, device=dev),
            "dry_breakers": torch.full((C, self.max_dry_breakers), -1, dtype=torch.int32, device=dev),
            "thinking_markers": torch.full((C, 3, L), -1, dtype=torch.long, device=dev),
            "thinking_match": torch.zeros((C, 3, L), dtype=torch.bool, device=dev),
            "thinking_count": torch.full((C,), thinking.NOT_THINKING, dtype=torch.int32, device=dev),
            **{f.name: torch.full((C,), float(f.neutral), dtype=torch.float32, device=dev)
               for f in STATE_FIELDS},
        }
        with self.guard.watch("allocating a batch"):
            xla.launch(list(self._state.values()))

    def _allocate_stages(self, specs: Sequence[StageSpec]) -> None:
        """The switch, argument and state tensors of custom stages, at full capacity."""
        C = self.capacity
        for spec in specs:
            for name, (dtype, value, shape) in _stage_tensors(spec, self.vocab_size).items():
                self._state[name] = torch.full((C, *shape), value, dtype=dtype, device=self.device)
        with self.guard.watch("allocating a custom stage's state"):
            xla.launch(list(self._state.values()))

    def _spec(self, name: str) -> StageSpec:
        specs = self.stage_specs()
        if name not in specs:
            known = ", ".join(sorted(specs)) or "none"
            raise ValueError(f"stages names unknown stage {name!r} (known stages: {known})")
        return specs[name][0]

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
        breakers = len(set(params.dry_sequence_breakers))
        if params.uses_dry and breakers > self.max_dry_breakers:
            raise ValueError(
                f"request {request_id!r}: dry_sequence_breakers holds {breakers} token ids; the "
                f"tpu backend was created with max_dry_breakers={self.max_dry_breakers}")
        if params.uses_thinking_budget:
            L = self.max_thinking_marker_length
            for name, marker in (("thinking_start_token_ids", params.thinking_start_token_ids),
                                 ("thinking_end_token_ids", params.thinking_end_token_ids),
                                 ("thinking_forced_token_ids", params.forced_thinking_ids)):
                if len(marker) > L:
                    raise ValueError(
                        f"request {request_id!r}: {name} holds {len(marker)} tokens; the tpu "
                        f"backend was created with max_thinking_marker_length={L}")
        if params.logprobs is not None:
            asked = self.vocab_size if params.logprobs == ALL_LOGPROBS else params.logprobs
            if asked > self.max_logprobs:
                every = " (-1 asks for every token of the vocabulary)" if params.logprobs == ALL_LOGPROBS else ""
                raise ValueError(
                    f"request {request_id!r}: logprobs={params.logprobs} asks for {asked} top "
                    f"logprobs{every}; the tpu backend was created with max_logprobs="
                    f"{self.max_logprobs} (its graphs have fixed shapes: create it with "
                    f"TpuSampler(max_logprobs=...) to allow more)")
        if self.fixed_stages is not None:
            for name in params.stage_args:
                if name not in self.fixed_stages:
                    raise ValueError(
                        f"request {request_id!r}: stage_args names stage {name!r}, which this "
                        f"sampler's graphs do not trace (created with stages={self.fixed_stages})")

    def _request_rows(self, params: SamplingParams, prompt: list[int]) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows shared by a request's children: additive row, prompt mask,
        stop mask, bad-word tables, DRY's breakers, the reasoning budget's markers."""
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
        breakers = torch.full((self.max_dry_breakers,), -1, dtype=torch.int32)
        if params.uses_dry:
            stops = sorted(set(params.dry_sequence_breakers))
            breakers[: len(stops)] = torch.tensor(stops, dtype=torch.int32)
        L = self.max_thinking_marker_length
        markers = torch.full((3, L), -1, dtype=torch.long)
        if params.uses_thinking_budget:
            markers = thinking.marker_table(params.thinking_start_token_ids,
                                            params.thinking_end_token_ids,
                                            params.forced_thinking_ids, L)
        rows = dict(static_add=add, prompt_mask=prompt_mask, stop_mask=stop, bad_prefix=prefix,
                    bad_last=last, bad_valid=valid, dry_breakers=breakers, thinking_markers=markers)
        return {name: t[None] for name, t in rows.items()}

    def _child_rows(self, params: SamplingParams, prompt: list[int], outputs: list[int],
                    stages: dict) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows of one child: output counts, recent-token window, DRY's
        window, the reasoning budget's matches and count (``corelib.thinking.replay`` of its
        history), and every allocated custom stage's switch, arguments and state."""
        V, P, H = self.vocab_size, self._prefix_width, self.dry_window
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=V).to(torch.int32)
        recent = torch.full((P,), -1, dtype=torch.long)
        tail = outputs[-P:]
        if tail:
            recent[P - len(tail):] = torch.tensor(tail, dtype=torch.long)
        tokens = prompt + outputs if params.uses_dry else []
        history, match, since = dry.initial_window(tokens, params.dry_sequence_breakers, H)
        L = self.max_thinking_marker_length
        think_match = torch.zeros((3, L), dtype=torch.bool)
        think_count = thinking.NOT_THINKING
        if params.uses_thinking_budget:
            bits, think_count = thinking.replay(prompt + outputs, params.thinking_start_token_ids,
                                                params.thinking_end_token_ids,
                                                params.forced_thinking_ids)
            think_match = thinking.bits_tensor(bits, L)
        rows = dict(output_counts=counts, recent=recent, dry_history=history, dry_match=match,
                    dry_since=torch.tensor(min(since, _INT32_MAX), dtype=torch.int32),
                    thinking_match=think_match,
                    thinking_count=torch.tensor(min(think_count, _INT32_MAX), dtype=torch.int32))
        rows.update(self._stage_rows(prompt, outputs, stages))
        return {name: t[None] for name, t in rows.items()}

    def _stage_rows(self, prompt: list[int], outputs: list[int], stages: dict) -> dict[str, torch.Tensor]:
        """Every allocated custom stage's row: the request's switch, arguments and initial
        state (``StageState.init``) where it uses the stage, neutral values elsewhere."""
        rows: dict[str, torch.Tensor] = {}
        for name in self._allocated_stages():
            spec = self._spec(name)
            neutral = _stage_tensors(spec, self.vocab_size)
            used = stages.get(name)
            for key, (dtype, value, shape) in neutral.items():
                rows[key] = torch.full(shape, value, dtype=dtype)
            if used is None:
                continue
            _, args = used
            rows[_stage_key(name, "active")] = torch.tensor(True)
            for field in spec.arg_fields():
                key = _stage_key(name, "arg", field)
                rows[key] = torch.tensor(getattr(args, field), dtype=rows[key].dtype)
            for state in spec.state:
                key = _stage_key(name, "state", state.name)
                rows[key] = _initial_state(spec, state, prompt, outputs, args, self.vocab_size, rows[key])
        return rows

    def _allocated_stages(self) -> list[str]:
        prefix, suffix = "stage:", ":active"
        return [key[len(prefix):-len(suffix)] for key in self._state
                if key.startswith(prefix) and key.endswith(suffix)]

    def _neutral_row(self) -> dict[str, torch.Tensor]:
        rows = self._request_rows(SamplingParams(), [])
        rows.update(self._child_rows(SamplingParams(), [], [], {}))
        rows.update({f.name: torch.tensor([float(f.neutral)]) for f in STATE_FIELDS})
        return rows

    def _order_index(self, params: SamplingParams) -> int:
        """A row's ``filter_order``: its order's place among the sampler's traced orders
        (``FilterOrders``; one it does not trace yet is added), 0 for the default order."""
        return self.orders.index(params.filter_order)

    def _write_device_row(self, row: int, values: dict[str, torch.Tensor]) -> None:
        """Write one row of every dense tensor (one graph: the row number is data)."""
        index = torch.tensor([row], dtype=torch.long).to(self.device)
        for name, tensor in self._state.items():
            tensor.index_copy_(0, index, values[name].to(self.device))
        with self.guard.watch("writing a row (add)"):
            xla.launch(list(self._state.values()))

    def _move_device_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy dense rows ``src`` to rows ``dst`` at once (one graph per pair count: the row
        numbers are data): all are read before any is written."""
        index = torch.tensor(src + dst, dtype=torch.long).to(self.device)
        m = len(src)
        for tensor in self._state.values():
            tensor.index_copy_(0, index[m:], tensor.index_select(0, index[:m]))
        with self.guard.watch(f"moving rows (remove, swap_rows: {m} at once)"):
            xla.launch(list(self._state.values()))


def _stage_tensors(spec: StageSpec, vocab_size: int) -> dict[str, tuple[torch.dtype, object, tuple]]:
    """A custom stage's per-row tensors: name -> (dtype, neutral value, per-row shape)."""
    tensors = {_stage_key(spec.name, "active"): (torch.bool, False, ())}
    for field, (dtype, default) in spec.arg_fields().items():
        tensors[_stage_key(spec.name, "arg", field)] = (dtype, default, ())
    for state in spec.state:
        shape = tuple(state.shape(vocab_size))
        tensors[_stage_key(spec.name, "state", state.name)] = (state.dtype, 0, shape)
    return tensors


def _initial_state(spec: StageSpec, state, prompt: list[int], outputs: list[int], args,
                   vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """``state.init`` for one row, checked like the core checks it (``StageError`` naming the
    stage on failure or a wrong shape)."""
    try:
        value = torch.as_tensor(state.init(list(prompt), list(outputs), args, vocab_size))
    except Exception as exc:
        raise StageError(f"{describe_stage(spec)}: state {state.name!r} init failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if tuple(value.shape) != tuple(like.shape):
        raise StageError(f"{describe_stage(spec)}: state {state.name!r} init returned shape "
                         f"{list(value.shape)}, expected {list(like.shape)}")
    return value.to(like.dtype)
