"""The sampler: a template method fixing the contract's stage order, and the reference stages.

``Sampler`` is the ``reference`` backend: every stage is plain, readable torch and is the
oracle for all other backends. A backend subclasses it and overrides the stages it does
faster; the order of the stages lives only in ``prepare``, ``filter`` and ``sample`` below.

Shapes: ``B`` rows, ``V`` vocabulary. Reference stages never modify their input tensors
(they return new ones), so a backend may call them on any tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .batch import SamplingBatch, StepState
from .noise import gumbel_from_uniform, row_keys, seeded_gumbel

NEG_INF = float("-inf")
INVALID_TOKEN = -1


@dataclass
class Logprobs:
    """Step 15's result. Column 0 is the sampled token, columns 1..N the top-N, best first."""

    token_ids: torch.Tensor  # int64 [B, N + 1]
    logprobs: torch.Tensor   # float32 [B, N + 1]
    ranks: torch.Tensor      # int64 [B]: tokens whose logprob >= the sampled token's


@dataclass
class SamplerOutput:
    """What ``Sampler.sample`` returns.

    ``valid[row]`` is False for a row whose logits held NaN or +inf, or whose every token was
    masked by steps 3-5, or whose drawn token's logit was not finite because float32 overflowed
    in steps 6-13 (finite logits near 3e38, a subnormal temperature); such a row's token id is
    -1 and it must not be appended as a token.
    """

    token_ids: torch.Tensor            # int64 [B]
    valid: torch.Tensor                # bool [B]
    logprobs: Optional[Logprobs] = None

    def raise_on_invalid(self, batch: SamplingBatch) -> None:
        """Raise ValueError naming the first flagged row's request (waits on the device)."""
        bad = (~self.valid).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            rid, child = batch.rows[row]
            raise ValueError(
                f"row {row} (request {rid!r}, child {child}) has no token to sample: its logits "
                f"are NaN/+inf or every token is masked by allowed_token_ids, bad_words and "
                f"min_tokens"
            )


def nucleus_keep(probs: torch.Tensor, ordered: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13's kept set: bool [B, V], True for tokens in the nucleus (ties at its edge kept).

    probs: float32 [B, V] renormalised over what steps 11-12 left; ordered: float32 [B, K], the
    row's K largest probs in descending order (K = V, or any K that holds the whole nucleus);
    top_p: float32 [B] (1 keeps every token). Mass is summed in float64. Not in place.
    """
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    # Token j (by rank) is in the nucleus when the mass strictly before it is < top_p.
    in_nucleus = mass_before < top_p.double()[:, None]
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1           # (B, 1)
    threshold = ordered.gather(1, last)
    return (probs >= threshold) | (top_p >= 1.0)[:, None]


class Sampler:
    """A sampling backend. This class is the ``reference`` backend; plugins subclass it."""

    name = "reference"
    default_device = "cpu"
    batch_class = SamplingBatch

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None):
        self.device = torch.device(device if device is not None else self.default_device)
        self.generator = generator

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> SamplingBatch:
        return self.batch_class(vocab_size, self.device, eos_token_id, logprobs_mode)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row. logits: ``[B, V]`` or ``[num_requests, V]``, any float dtype.

        The caller's tensor is never modified.
        """
        s = self.step_state(logits, batch)
        if s.num_rows == 0:
            return self.empty_output(s)
        return self.sample_state(logits, batch, s)

    def sample_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        """Steps 1-15 for a given step state: the contract's stage order, in one place.

        Split from ``sample`` so a backend can capture it (CUDA graphs) or trace it (XLA)."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8
        greedy_ids = self.argmax(x) if s.any_greedy else None              # step 9
        final, token_ids = x, greedy_ids
        if s.any_random:
            token_ids, final = self.sample_random(x, s)                    # steps 10-14
            if greedy_ids is not None:
                token_ids = torch.where(s.greedy, greedy_ids, token_ids)
        valid = valid & self.drawn_is_finite(x, final, token_ids, s)
        logprobs = None
        if s.num_logprobs is not None:                                     # step 15
            source = raw if s.logprobs_mode == "raw" else self.processed_source(x, final, s)
            logprobs = self.gather_logprobs(source, token_ids, s.num_logprobs)
        token_ids = torch.where(valid, token_ids, torch.full_like(token_ids, INVALID_TOKEN))
        return SamplerOutput(token_ids, valid, logprobs)

    def sample_random(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 10-14 for every row (greedy rows' results are replaced by the caller).

        x: float32 [B, V] after step 8. Returns (int64 [B] drawn ids, float32 [B, V] final
        logits, dropped tokens -inf). A backend whose kernel fuses filtering and drawing
        overrides this; the final logits are read for processed logprobs and overflow checks.
        """
        final = self.filter(x, s)                                          # steps 10-13
        return self.draw(final, s), final                                  # step 14

    def step(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``sample`` then ``batch.append`` of the sampled tokens."""
        out = self.sample(logits, batch)
        batch.append(out.token_ids)
        return out

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 ``[B, V]``: the final distribution's logits (steps 2-13; greedy rows stop
        after step 8); dropped tokens are -inf. Its log_softmax is the processed logprobs."""
        s = self.step_state(logits, batch)
        x, _, _ = self.prepare(logits, batch, s)
        final = self.filter(x, s) if s.any_random else x
        return self.processed_source(x, final, s, normalise=False)

    # ------------------------------------------------------------------ template parts
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> StepState:
        batch.check_logits(logits)
        if batch.device.type != self.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        return batch.step_state()

    def prepare(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState):
        """Steps 1-8. Returns (float32 [B, V] logits after penalties, raw logprobs or None,
        bool [B] valid rows). Invalid rows are replaced by zeros so they cannot poison
        shared reductions; their results are flagged, not used."""
        x = self.working_copy(logits, batch, s)                            # step 2
        raw = None
        if s.num_logprobs is not None and s.logprobs_mode == "raw":
            raw = self.log_softmax(x)                                      # step 1
        finite = self.finite_rows(x)
        if s.any_allowed:
            x = self.apply_allowed_ids(x, s)                               # step 3
        if s.any_bad_words:
            x = self.apply_bad_words(x, s)                                 # step 4
        if s.any_min_tokens:
            x = self.apply_min_tokens(x, s)                                # step 5
        valid = finite & self.any_token_left(x)
        x = self.neutralise_rows(x, valid)
        if s.any_bias:
            x = self.apply_logit_bias(x, s)                                # step 6
        if s.any_penalties:
            x = self.apply_penalties(x, s)                                 # steps 7-8
        return x, raw, valid

    def filter(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 10-13 for every row (greedy rows' results are ignored by the caller)."""
        if s.any_temperature:
            x = self.apply_temperature(x, s)                               # step 10
        if s.any_min_p:
            x = self.apply_min_p(x, s)                                     # step 11
        if s.any_top_k or s.any_top_p:
            x = self.apply_top_k_top_p(x, s)                               # steps 12-13
        return x

    def processed_source(self, x: torch.Tensor, final: torch.Tensor, s: StepState,
                         normalise: bool = True) -> torch.Tensor:
        """The logits of the final distribution: ``final`` for random rows, ``x`` for greedy."""
        chosen = torch.where(s.greedy[:, None], x, final) if s.any_greedy else final
        return self.log_softmax(chosen) if normalise else chosen

    def drawn_is_finite(self, x: torch.Tensor, final: torch.Tensor, token_ids: torch.Tensor,
                        s: StepState) -> torch.Tensor:
        """bool [B]: the drawn id is in [0, V) and its logit is finite in the distribution it
        came from (``x`` [B, V] for greedy rows, ``final`` [B, V] for the others). False where
        float32 overflowed after step 5 (huge finite logits divided by a small temperature or
        a repetition penalty < 1, a subnormal temperature): the stages then see +inf/NaN and
        may drop every token, so the row is flagged instead of returning an arbitrary id.
        O(B): gathers one value per row. Not in place."""
        V = x.shape[-1]
        in_range = (token_ids >= 0) & (token_ids < V)
        safe = token_ids.clamp(0, V - 1)[:, None]
        picked = final.gather(1, safe)
        if s.any_greedy and final is not x:
            picked = torch.where(s.greedy[:, None], x.gather(1, safe), picked)
        return in_range & torch.isfinite(picked[:, 0])

    def empty_output(self, s: StepState) -> SamplerOutput:
        ids = torch.empty(0, dtype=torch.long, device=self.device)
        valid = torch.empty(0, dtype=torch.bool, device=self.device)
        logprobs = None
        if s.num_logprobs is not None:
            width = s.num_logprobs + 1
            logprobs = Logprobs(torch.empty((0, width), dtype=torch.long, device=self.device),
                                torch.empty((0, width), dtype=torch.float32, device=self.device),
                                torch.empty(0, dtype=torch.long, device=self.device))
        return SamplerOutput(ids, valid, logprobs)

    # ------------------------------------------------------------------ stages
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """Step 2: a float32 ``[B, V]`` copy; one logits row per request is expanded to its
        children. Never aliases ``logits``."""
        if logits.shape[0] != s.num_rows:
            return logits.index_select(0, batch.request_index(s.num_rows)).to(torch.float32)
        return logits.to(torch.float32, copy=True)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, V]`` -> float32 ``[B, V]`` log-probabilities; not in place."""
        return torch.log_softmax(x, dim=-1)

    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows free of NaN and +inf (-inf is a legitimate mask)."""
        return ~(torch.isnan(x) | (x == float("inf"))).any(dim=-1)

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows with at least one token not masked to -inf."""
        return (x > NEG_INF).any(dim=-1)

    def neutralise_rows(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Replace invalid rows by zeros (uniform); returns a new tensor."""
        return torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    def apply_allowed_ids(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 3: tokens outside a row's allowed set -> -inf. ``s.allowed_mask`` bool [B, V]
        (all True for rows without the option). Not in place."""
        return x.masked_fill(~s.allowed_mask, NEG_INF)

    def apply_bad_words(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 4: ban each bad word's last token when the row's generated tokens end with the
        rest of the word. ``bad_prefix`` int64 [B, W, P] (right-aligned, -2 matches anything),
        ``recent`` int64 [B, P] (last P generated, -1 before any), ``bad_last`` [B, W],
        ``bad_valid`` bool [B, W] (False for padding words). Not in place."""
        recent = s.recent[:, None, :]                                      # (B, 1, P)
        prefix_matches = ((s.bad_prefix == recent) | (s.bad_prefix == -2)).all(dim=-1)
        banned = prefix_matches & s.bad_valid                              # (B, W)
        return self._add_at(x, s.bad_last, banned)

    def apply_min_tokens(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 5: while ``position < min_tokens``, stop ids and eos -> -inf. ``stop_ids``
        int64 [B, S] with ``stop_valid`` bool [B, S]. Not in place."""
        pending = (s.position < s.min_tokens)[:, None]                     # (B, 1)
        return self._add_at(x, s.stop_ids, s.stop_valid & pending)

    def apply_logit_bias(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 6: ``x[row, bias_ids] += bias_values`` (padding adds 0 to token 0). Not in place."""
        return x.scatter_add(1, s.bias_ids, s.bias_values)

    def apply_penalties(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 7-8 from running counts. ``prompt_mask`` bool [B, V], ``output_counts`` int32
        [B, V]; penalties float32 [B] (1, 0, 0 disable them). Not in place."""
        counts = s.output_counts
        seen = s.prompt_mask | (counts > 0)
        r = s.repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)           # step 7
        occurred = (counts > 0).to(torch.float32)
        return (x - s.frequency_penalty[:, None] * counts.to(torch.float32)
                - s.presence_penalty[:, None] * occurred)                    # step 8

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Step 9: int64 [B], the lowest id among the row's maxima."""
        return torch.argmax(x, dim=-1)

    def apply_temperature(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10: ``x / temperature`` per row (greedy rows divide by 1). Not in place."""
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        return x / t[:, None]

    def apply_min_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11: drop tokens with prob < min_p * max prob (min_p 0 keeps all). Not in place."""
        probs = torch.softmax(x, dim=-1)
        threshold = s.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        return x.masked_fill(probs < threshold, NEG_INF)

    def apply_top_k_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 12-13 by a full sort (the reference; fast backends avoid the sort).

        top_k int32 [B] (0 = off): keep logits >= the k-th largest. top_p float32 [B] (1 = off):
        keep the smallest most-likely set whose mass >= top_p of what is left, ties at the
        boundary kept, never fewer than one token. Not in place."""
        if s.any_top_k:
            x = self.apply_top_k(x, s)
        if s.any_top_p:
            x = self.apply_top_p(x, s)
        return x

    def apply_top_k(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 12 alone; see ``apply_top_k_top_p``."""
        V = x.shape[-1]
        k = s.top_k.to(torch.long).clamp(max=V)
        ordered = torch.sort(x, dim=-1, descending=True).values
        kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])            # (B, 1)
        keep = (x >= kth) | (k == 0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13 alone; see ``apply_top_k_top_p``. Mass is summed in float64."""
        probs = torch.softmax(x, dim=-1)
        ordered = torch.sort(probs, dim=-1, descending=True).values
        return x.masked_fill(~nucleus_keep(probs, ordered, s.top_p), NEG_INF)

    def draw(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14: int64 [B] by the Gumbel-max race ``argmax(x + gumbel)`` over kept tokens
        (x float32 [B, V], dropped tokens -inf). Seeded rows use the contract's noise
        function; others this sampler's generator. Never waits on the host."""
        B, V = x.shape
        noise = torch.zeros_like(x)
        if s.any_unseeded:
            u = torch.rand(x.shape, generator=self.generator, device=x.device)
            noise = gumbel_from_uniform(u)
        if s.any_seeded:
            keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)[:, None]
            vocab = torch.arange(V, dtype=torch.int32, device=x.device)[None, :]
            noise = torch.where(s.seeded[:, None], seeded_gumbel(keys, vocab), noise)
        return torch.argmax(x + noise, dim=-1)

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 from float32 [B, V] log-probabilities and int64 [B] sampled ids."""
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (B, 1)
        ranks = (logprobs >= sampled).sum(dim=-1)
        ids, values = [safe], [sampled]
        available = min(num_logprobs, logprobs.shape[-1])
        if available > 0:
            top_values, top_ids = self.top_logprobs(logprobs, available)
            ids.append(top_ids)
            values.append(top_values)
        if available < num_logprobs:  # a vocabulary smaller than N: pad with id -1, -inf
            missing = (logprobs.shape[0], num_logprobs - available)
            ids.append(torch.full(missing, -1, dtype=torch.long, device=logprobs.device))
            values.append(torch.full(missing, NEG_INF, device=logprobs.device))
        return Logprobs(torch.cat(ids, dim=1), torch.cat(values, dim=1), ranks)

    def top_logprobs(self, logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` (<= V) best entries of float32 [B, V] log-probabilities, best first:
        (float32 [B, n] values, int64 [B, n] ids). Not in place."""
        top = torch.topk(logprobs, n, dim=-1)
        return top.values, top.indices

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _add_at(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        """Set ``x[row, ids[row, j]]`` to -inf where ``banned[row, j]``; returns a new tensor."""
        penalty = torch.where(banned, NEG_INF, 0.0).to(x.dtype)
        return x.scatter_add(1, ids, penalty)
