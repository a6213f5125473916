"""The conformance suite's checks of the fourth release: the new filters against hand
computations, draws over their kept sets, per-request orders in one batch, and the stateful
selectors' recurrences, moves and round trips. Mixed into ``ConformanceSuite``, so every
backend (third-party ones included) proves them.

The hand computations below are the contract's formulas in float64 Python, token by token:
written apart from every backend (the reference included) so that a shared mistake shows.
Each case's logits keep their tokens away from the thresholds (``MARGIN``), so float32 and
float64 agree on the kept set.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional, Sequence

import pytest
import torch

from ..params import SamplingParams
from .rules import PROMPT, chi_square_p_value, params_text, violation

NEG_INF = float("-inf")
#: Relative distance a case's probabilities keep from any threshold.
MARGIN = 1e-4
#: Tolerance of kept logits against the hand computation (float32 against float64).
TOLERANCE = 2e-4

LIVE = [3.0, 2.2, 2.2, 1.0, 0.3, -0.5, -1.7, -3.0]      # two tokens tied below the top
TIED_TOP = [1.0, 1.0, 0.2, -0.4, -1.0, -2.0, -2.5, -4.0]  # two tokens tied at the top
TWO = [0.5, -0.5]                                      # two tokens only
ONE = [0.7]                                            # one token only


# --------------------------------------------------------------------------- hand computations
def _probs(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(v - top) if v != NEG_INF else 0.0 for v in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _entropy(p: Sequence[float]) -> float:
    return -sum(q * math.log(q) for q in p if q > 0)


def _cut(logits: list[float], threshold: float) -> list[float]:
    """Drop tokens with p < threshold, never the most likely ones."""
    p = _probs(logits)
    most = max(p)
    _check_margin(p, threshold)
    return [v if (q >= threshold or q == most) else NEG_INF for v, q in zip(logits, p)]


def _check_margin(p: Sequence[float], threshold: float) -> None:
    for q in p:
        if q > 0 and abs(q - threshold) <= MARGIN * threshold:
            raise AssertionError(f"hand case too close to its threshold: p={q}, threshold={threshold}")


def hand_top_a(logits, a):
    return _cut(logits, a * max(_probs(logits)) ** 2)


def hand_epsilon(logits, eps):
    return _cut(logits, eps)


def hand_eta(logits, eta):
    return _cut(logits, min(eta, math.sqrt(eta) * math.exp(-_entropy(_probs(logits)))))


def hand_p_less(logits, mode, V):
    p = _probs(logits)
    collision = sum(q * q for q in p)
    return _cut(logits, collision if mode == "plain" else (V * collision - 1) / (V - 1))


def hand_tfs(logits, z):
    p = _probs(logits)
    q = sorted((x for x in p if x > 0), reverse=True)
    n = len(q)
    if n <= 2:
        return list(logits)
    second = [abs(q[i] - 2 * q[i + 1] + q[i + 2]) for i in range(n - 2)]
    total = sum(second)
    weights = [a / total for a in second] if total > 1e-6 else [1 / (n - 2)] * (n - 2)
    j, running = n - 2, 0.0
    for i, w in enumerate(weights):
        running += w
        if abs(running - z) <= MARGIN:
            raise AssertionError(f"hand tail-free case too close to z: {running} vs {z}")
        if running > z:
            j = i + 1
            break
    return [v if x >= q[j - 1] else NEG_INF for v, x in zip(logits, p)]


def hand_smoothing(logits, f, c):
    m = max(logits)
    return [m - (3 - c) / 2 * f * (v - m) ** 2 + (c - 1) / 2 * f * (v - m) ** 3 if v != NEG_INF
            else NEG_INF for v in logits]


def hand_dynatemp(logits, t, d, exponent):
    p = _probs(logits)
    n = sum(1 for q in p if q > 0)
    if n <= 1:
        return list(logits)
    lo, hi = max(0.0, t - d), t + d
    temp = lo + (hi - lo) * (_entropy(p) / math.log(n)) ** exponent
    return [v / temp for v in logits]


def hand_mirostat_first(logits, tau):
    p = _probs(logits)
    most = max(p)
    mu = 2 * tau
    return [v if (q > 0 and (-math.log2(q) <= mu or q == most)) else NEG_INF for v, q in zip(logits, p)]


def hand_adaptive(logits, target, weighted, total):
    aim = min(1.0, max(0.0, 2 * target - weighted / total))
    out = []
    for v, q in zip(logits, _probs(logits)):
        u = abs(q - aim) / 0.3
        out.append(5 - 10 * u * u / (1 + u) if v != NEG_INF else NEG_INF)
    return out


def hand_mirostat_advance(mu, tau, eta, logits, token):
    """mu after ``token`` is appended, from the distribution after the filter group."""
    kept = hand_mirostat_first_with_mu(logits, mu)
    p = _probs(kept)
    bits = -math.log2(p[token]) if p[token] > 0 else 64.0
    return mu - eta * (bits - tau)


def hand_mirostat_first_with_mu(logits, mu):
    p = _probs(logits)
    most = max(p)
    return [v if (q > 0 and (-math.log2(q) <= mu or q == most)) else NEG_INF for v, q in zip(logits, p)]


# (params, live logits, what the row's final logits must be); V = the suite's vocabulary
def hand_cases(V: int) -> dict[str, tuple[dict, list, list]]:
    return {
        "top_a": (dict(top_a=0.5), LIVE, hand_top_a(LIVE, 0.5)),
        "top_a_tied_top": (dict(top_a=0.99), TIED_TOP, hand_top_a(TIED_TOP, 0.99)),
        "epsilon": (dict(epsilon_cutoff=0.05), LIVE, hand_epsilon(LIVE, 0.05)),
        "epsilon_keeps_the_tied_top": (dict(epsilon_cutoff=0.6), TIED_TOP, hand_epsilon(TIED_TOP, 0.6)),
        "eta": (dict(eta_cutoff=0.03), LIVE, hand_eta(LIVE, 0.03)),
        "tfs": (dict(tfs=0.5), LIVE, hand_tfs(LIVE, 0.5)),
        "tfs_two_tokens": (dict(tfs=0.1), TWO, list(TWO)),
        "p_less_plain": (dict(p_less="plain"), LIVE, hand_p_less(LIVE, "plain", V)),
        "p_less_norm": (dict(p_less="norm"), LIVE, hand_p_less(LIVE, "norm", V)),
        "smoothing": (dict(smoothing_factor=0.5, smoothing_curve=1.0), LIVE, hand_smoothing(LIVE, 0.5, 1.0)),
        "smoothing_curve": (dict(smoothing_factor=0.4, smoothing_curve=2.5), LIVE,
                            hand_smoothing(LIVE, 0.4, 2.5)),
        "dynatemp": (dict(temperature=0.8, dynatemp_range=0.5, dynatemp_exponent=1.5), LIVE,
                     hand_dynatemp(LIVE, 0.8, 0.5, 1.5)),
        "dynatemp_one_token": (dict(temperature=0.5, dynatemp_range=0.4), ONE, list(ONE)),
        "mirostat": (dict(mirostat_tau=1.5), LIVE, hand_mirostat_first(LIVE, 1.5)),
        "adaptive_p": (dict(adaptive_p_target=0.2, adaptive_p_decay=0.5), LIVE,
                       hand_adaptive(LIVE, 0.2, 0.2 / 0.5, 1 / 0.5)),
        # an order of its own: top-k 2 first (the tie at 2.2 kept), then min-p on what is left,
        # then temperature: the filters see the untempered distribution
        # then temperature: the filters see the untempered distribution (the default order
        # would keep token 0 alone: min-p 0.4 after T 0.5 drops the two at 2.2)
        "order": (dict(sampler_order=["top_k", "min_p", "temperature"], top_k=2, min_p=0.4,
                       temperature=0.5), LIVE,
                  [v / 0.5 if v >= 2.2 else NEG_INF for v in LIVE]),
    }


def case_rule(case: str) -> str:
    """The rule (``RULES``) a hand case checks: its stage's, or the order's."""
    for prefix, rule in (("dynatemp", "temperature"), ("order", "order"), ("p_less", "p_less"),
                         ("top_a", "top_a"), ("adaptive_p", "adaptive_p")):
        if case.startswith(prefix):
            return rule
    return case.split("_")[0]


# Parameter sets whose draws the chi-square test checks (the distribution of a first step).
DRAW_CASES = {
    "new_filters": dict(temperature=0.9, dynatemp_range=0.3, smoothing_factor=0.2, top_a=0.02,
                        epsilon_cutoff=0.002, eta_cutoff=0.002, tfs=0.98, p_less="norm"),
    "mirostat": dict(mirostat_tau=5.0, mirostat_eta=0.1),
    "adaptive_p": dict(adaptive_p_target=0.05, min_p=0.01),
    "order": dict(temperature=0.7, top_k=60, min_p=0.02, sampler_order=["top_k", "min_p", "temperature"]),
}


class FourthReleaseConformance:
    """The fourth release's checks; ``ConformanceSuite`` supplies the fixtures and helpers."""

    def _live_logits(self, live: Sequence[float], rows: int = 1) -> torch.Tensor:
        x = torch.full((rows, self.vocab_size), NEG_INF)
        x[:, :len(live)] = torch.tensor(live)
        return x

    # ------------------------------------------------------------------ kept sets by hand
    @pytest.mark.parametrize("case", sorted(hand_cases(256)))
    def test_new_filters_match_the_hand_computation(self, sampler, case):
        params, live, want = hand_cases(self.vocab_size)[case]
        params = SamplingParams(**params)
        # the case's row between two rows that use nothing, so a stage that leaks shows
        batch = self.build(sampler, [("before", SamplingParams(), [], None),
                                     ("case", params, [], None),
                                     ("after", SamplingParams(top_k=3), [], None)])
        got = sampler.processed_logits(self.on(sampler, self._live_logits(live, 3)), batch).cpu()
        row = got[1, :len(live)].double().tolist()
        kept_got = [v != NEG_INF for v in row]
        kept_want = [v != NEG_INF for v in want]
        where = f"{self.describe(batch, 1)} on live logits {live} (the rest -inf)"
        rule = case_rule(case)
        if kept_got != kept_want:
            violation(rule, f"kept {[i for i, k in enumerate(kept_got) if k]}, the contract keeps "
                            f"{[i for i, k in enumerate(kept_want) if k]} at {where}")
        if bool(torch.isfinite(got[1, len(live):]).any()):
            violation(rule, f"a token whose logit was -inf came back at {where}")
        for token, (g, w) in enumerate(zip(row, want)):
            if w != NEG_INF and abs(g - w) > TOLERANCE * max(1.0, abs(w)):
                violation(rule, f"token {token} has logit {g:.6g}, the contract's {w:.6g} at {where}")
        if not torch.equal(got[0], self._live_logits(live)[0]):
            violation(rule, f"row 0, which uses no filter, changed next to {where}")

    # ------------------------------------------------------------------ draws
    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    @pytest.mark.parametrize("case", sorted(DRAW_CASES))
    def test_draws_follow_the_kept_set_of_each_new_sampler(self, sampler, reference, case, seeded):
        params = DRAW_CASES[case]
        logits = self.logits(1, seed=11, scale=1.5)
        probe = self.build(reference, [("p", SamplingParams(**params), [], None)])
        probs = torch.softmax(reference.processed_logits(logits, probe)[0].double(), dim=-1)
        kept = probs > 0
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        torch.manual_seed(4321)
        for call in range(max(1, self.draw_calls // 2)):    # eight cases: half the calls each
            requests = [(f"d{call}-{i}", SamplingParams(
                **params, seed=(call * self.draw_rows + i) if seeded else None), [], None)
                for i in range(self.draw_rows)]
            batch = self.build(sampler, requests)
            ids = sampler.sample(self.on(sampler, logits.expand(self.draw_rows, -1)), batch).token_ids.cpu()
            outside = torch.nonzero((ids < 0) | (ids >= self.vocab_size) | ~kept[ids.clamp(0, self.vocab_size - 1)])
            if outside.numel():
                row = int(outside[0])
                violation("draw", f"token {int(ids[row])}, outside the kept set, drawn at "
                                  f"{self.describe(batch, row)} (case {case!r}, call {call})")
            counts += torch.bincount(ids, minlength=self.vocab_size)
        p = chi_square_p_value(counts[kept], probs[kept])
        if not p > self.min_p_value:
            violation("draw", f"case {case!r} ({params_text(params)}, "
                              f"{'seeded' if seeded else 'unseeded'}): draws do not follow the "
                              f"reference distribution (chi-square p={p:.2e} < {self.min_p_value:.0e}, "
                              f"{int(counts.sum())} draws)")

    # ------------------------------------------------------------------ orders
    ORDER_REQUESTS = (
        ("default", dict(temperature=0.5, min_p=0.2, top_k=10, seed=1)),
        ("temperature_last", dict(temperature=0.5, min_p=0.2, top_k=10, seed=2, temperature_last=True)),
        ("top_k_first", dict(temperature=0.5, min_p=0.2, top_k=10, seed=3,
                             sampler_order=["top_k", "min_p", "temperature"])),
        ("top_p_apart", dict(temperature=1.5, top_p=0.8, top_k=6, min_p=0.05, seed=4,
                             sampler_order=["top_p", "min_p", "top_k", "temperature"])),
        ("xtc_first", dict(xtc_probability=1.0, xtc_threshold=0.05, tfs=0.9, temperature=0.8,
                           smoothing_factor=0.3, seed=5,
                           sampler_order=["xtc", "smoothing", "temperature", "tfs"])),
        ("every_new", dict(temperature=1.2, dynatemp_range=0.3, top_a=0.05, eta_cutoff=0.002,
                           p_less="plain", seed=6,
                           sampler_order=["p_less", "eta", "top_a", "temperature"])),
    )

    def test_rows_with_different_orders_share_a_batch_each_as_alone(self, sampler, reference):
        requests = [(name, SamplingParams(**params), PROMPT, None) for name, params in self.ORDER_REQUESTS]
        logits = self.logits(len(requests), seed=21)
        batch = self.build(sampler, requests)
        together = sampler.processed_logits(self.on(sampler, logits), batch).cpu()
        ids = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu()
        for row, request in enumerate(requests):
            alone_batch = self.build(reference, [request])
            alone = reference.processed_logits(logits[row:row + 1], alone_batch)[0]
            where = f"{self.describe(batch, row)} in a batch of {len(requests)} orders"
            if not torch.equal(torch.isfinite(together[row]), torch.isfinite(alone)):
                violation("order", f"kept set differs from the request alone (reference) at {where}")
            kept = torch.isfinite(alone)
            if not torch.allclose(together[row][kept], alone[kept], rtol=1e-5, atol=1e-5):
                violation("order", f"kept logits differ from the request alone at {where}")
            alone_id = int(reference.sample(logits[row:row + 1], self.build(reference, [request])).token_ids[0])
            if int(ids[row]) != alone_id:
                violation("order", f"seeded token {int(ids[row])} differs from {alone_id} drawn "
                                   f"alone at {where}")
        # the orders matter here: the top-k-first row keeps another set in the default order
        default = SamplingParams(**{k: v for k, v in self.ORDER_REQUESTS[2][1].items() if k != "sampler_order"})
        in_default = reference.processed_logits(logits[2:3], self.build(reference, [("d", default, PROMPT, None)]))[0]
        if torch.equal(torch.isfinite(together[2]), torch.isfinite(in_default)):
            raise AssertionError("the order case does not tell top-k first from the default order")

    def test_seeded_draws_are_unchanged_by_the_order_of_stages_that_drop_nothing(self, sampler):
        # epsilon 1e-30 and top-k 256 keep every token: wherever they run, the draw is the same
        base = dict(temperature=0.7, epsilon_cutoff=1e-30, top_k=self.vocab_size, seed=9)
        orders = [None, ["epsilon", "top_k", "temperature"], ["top_k", "temperature", "epsilon"]]
        # one request id, so each order sees the same logits (``_run_steps``: by request)
        tokens = [self._run_steps(sampler, self.build(sampler, [("o", SamplingParams(
            **base, sampler_order=order), [], None)]), steps=4)[("o", 0)] for order in orders]
        for order, drawn in zip(orders[1:], tokens[1:]):
            if drawn != tokens[0]:
                violation("order", f"sampler_order {order} drew {drawn}, the default order "
                                   f"{tokens[0]}: those stages drop nothing")

    # ------------------------------------------------------------------ selectors' state
    def test_selector_state_follows_the_contracts_recurrence(self, sampler):
        tau, eta, target, decay = 3.0, 0.3, 0.25, 0.8
        requests = [("mirostat", SamplingParams(mirostat_tau=tau, mirostat_eta=eta, min_p=0.02, seed=3), [], None),
                    ("plain", SamplingParams(seed=4), [], None),
                    ("adaptive", SamplingParams(adaptive_p_target=target, adaptive_p_decay=decay,
                                                min_p=0.02, seed=5), [], None)]
        batch = self.build(sampler, requests)
        mu = 2 * tau
        weighted, total = target / (1 - decay), 1 / (1 - decay)
        for step in range(6):
            logits = self.logits(3, seed=100 + step, scale=2.0)
            ids = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu().tolist()
            batch.append(ids)
            filtered = [_min_p(logits[row].double().tolist(), 0.02) for row in range(3)]
            if not _probs(hand_mirostat_first_with_mu(filtered[0], mu))[ids[0]] > 0:
                violation("mirostat", f"step {step}: token {ids[0]}, which mirostat (mu {mu:.4f}) "
                                      f"drops, was drawn at {self.describe(batch, 0)}")
            mu = hand_mirostat_advance(mu, tau, eta, filtered[0], ids[0])
            weighted = _probs(filtered[2])[ids[2]] + decay * weighted
            total = 1 + decay * total
            got_mu = batch.sampler_state("mirostat")[0][0]
            got_w, got_s = batch.sampler_state("adaptive")[0]
            if abs(got_mu - mu) > 1e-3 * max(1.0, abs(mu)):
                violation("mirostat", f"after step {step} (token {ids[0]}) mu is {got_mu:.6g}, the "
                                      f"contract's recurrence gives {mu:.6g}")
            if abs(got_w - weighted) > 1e-4 * total or abs(got_s - total) > 1e-4 * total:
                violation("adaptive_p", f"after step {step} (token {ids[2]}) the state is "
                                        f"({got_w:.6g}, {got_s:.6g}), the contract's "
                                        f"({weighted:.6g}, {total:.6g})")
        if batch.sampler_state("plain") != [[]]:
            violation("mirostat", f"a request without a selector has state {batch.sampler_state('plain')}")

    def test_a_flagged_row_leaves_the_selector_state_unchanged(self, sampler):
        batch = self.build(sampler, [("m", SamplingParams(mirostat_tau=2.0, seed=1), [], None)])
        before = batch.sampler_state("m")
        sampler.sample(self.on(sampler, self.logits(1, seed=3)), batch)
        batch.append([-1])
        if batch.sampler_state("m") != before:
            violation("mirostat", f"appending -1 moved the state from {before} to {batch.sampler_state('m')}")

    def _selector_requests(self):
        return [("m", SamplingParams(mirostat_tau=3.0, mirostat_eta=0.5, seed=31, n=2), PROMPT, None),
                ("a", SamplingParams(adaptive_p_target=0.2, adaptive_p_decay=0.7, seed=32), PROMPT, None),
                ("o", SamplingParams(temperature=0.8, top_k=20, min_p=0.1, seed=33,
                                     sampler_order=["min_p", "top_k", "temperature"]), PROMPT, None)]

    def _state_run(self, sampler, steps: int, stop_at: Optional[int] = None, other=None,
                   churn: bool = False) -> dict:
        """{(request, child): tokens} over ``steps`` steps; at ``stop_at`` every request moves
        out (``sampler_state``) and back in, into a batch of ``other`` (a sampler) when given.
        ``churn``: other requests join, leave and rows swap between steps."""
        requests = self._selector_requests()
        batch = self.build(sampler, requests)
        tokens: dict = {(rid, c): [] for rid, p, _, _ in requests for c in range(p.n)}
        for step in range(steps):
            if step == stop_at:
                saved = {rid: (p, batch.sampler_state(rid)) for rid, p, _, _ in requests}
                if other is not None:
                    sampler, batch = other, other.new_batch(self.vocab_size)
                for rid, (p, state) in saved.items():
                    if rid in batch:
                        batch.remove(rid)
                    history = [tokens[(rid, c)] for c in range(p.n)]
                    batch.add(rid, p, prompt_token_ids=PROMPT,
                              output_token_ids=history if p.n > 1 else history[0], sampler_state=state)
            if churn:
                batch.add(f"noise{step}", SamplingParams(temperature=1.3, top_k=5), prompt_token_ids=[step])
                if step % 2:
                    batch.remove(f"noise{step - 1}")
                batch.swap_rows(0, len(batch.rows) - 1)
            logits = torch.stack([self.logits(1, seed=500 + step * 7 + zlib.crc32(repr(key).encode()) % 97,
                                              scale=2.0)[0] for key in batch.rows])
            out = sampler.sample(self.on(sampler, logits), batch)
            for key, token in zip(batch.rows, out.token_ids.cpu().tolist()):
                if key in tokens:
                    tokens[key].append(token)
            batch.append(out.token_ids)
        return tokens

    def test_selector_state_moves_with_rows_that_join_leave_and_swap(self, sampler):
        straight, churned = self._state_run(sampler, 6), self._state_run(sampler, 6, churn=True)
        for key, want in straight.items():
            if churned[key] != want:
                violation("selector_state", f"request {key[0]!r} child {key[1]} drew {churned[key]} "
                                            f"while others joined, left and swapped, {want} alone")

    @pytest.mark.parametrize("onto", ["same", "reference"])
    def test_sampler_state_moves_a_request_exactly(self, sampler, reference, onto):
        straight = self._state_run(sampler, 6)
        moved = self._state_run(sampler, 6, stop_at=3, other=reference if onto == "reference" else None)
        for key, want in straight.items():
            if moved[key] != want:
                violation("selector_state", f"request {key[0]!r} child {key[1]} moved after 3 "
                                            f"tokens with sampler_state (onto {onto}) drew "
                                            f"{moved[key]}, uninterrupted {want}")

    @pytest.mark.parametrize("bad,fragment", [
        ([[1.0], [2.0]], "must be a list of 1 lists"),
        ([[1.0, 2.0]], "must be a list of 1 floats"),
        ([["x"]], "mirostat_mu must be a finite float"),
        ([[float("nan")]], "mirostat_mu must be a finite float"),
        ([[True]], "mirostat_mu must be a finite float"),
        ("state", "must be a list of 1 lists"),
    ])
    def test_a_malformed_sampler_state_raises_and_leaves_the_batch_as_it_was(self, sampler, bad, fragment):
        batch = self.build(sampler, [("keep", SamplingParams(mirostat_tau=2.0, seed=1), [], None)])
        sampler.sample(self.on(sampler, self.logits(1, seed=1)), batch)
        batch.append([5])
        before, rows = batch.sampler_state("keep"), list(batch.rows)
        with pytest.raises(ValueError) as err:
            batch.add("new", SamplingParams(mirostat_tau=3.0), sampler_state=bad)
        if "sampler_state" not in str(err.value) or fragment not in str(err.value):
            violation("selector_state", f"sampler_state={bad!r} raised {err.value!s}, which does "
                                        f"not name the field and the problem ({fragment!r})")
        if batch.rows != rows or batch.sampler_state("keep") != before or "new" in batch:
            violation("selector_state", f"a refused sampler_state={bad!r} changed the batch")


def _min_p(logits: list[float], min_p: float) -> list[float]:
    p = _probs(logits)
    most = max(p)
    return [v if q >= min_p * most else NEG_INF for v, q in zip(logits, p)]
