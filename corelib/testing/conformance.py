"""The shared conformance suite: every backend against the reference backend.

Use it from a backend's own tests::

    from corelib.testing import ConformanceSuite

    class TestConformance(ConformanceSuite):
        backend = "mybackend"            # a name corelib.get_sampler() accepts

Override ``make_sampler`` to build the sampler another way, and the class attributes below to
size the statistical tests for a slow device. Every failure names the contract rule, the row and
the row's parameters.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import pytest
import torch

from ..params import SamplingParams
from ..sampler import Sampler

Request = tuple  # (request_id, SamplingParams, prompt_token_ids, output_token_ids or None)

# The kept-set cases: one stage (or a combination) each, on random logits.
STAGE_CASES: dict[str, dict] = {
    "temperature": dict(temperature=0.7),
    "min_p": dict(min_p=0.05),
    "top_k": dict(top_k=20),
    "top_k_ties": dict(top_k=5),
    "top_p": dict(top_p=0.9),
    "top_p_small": dict(top_p=0.2, temperature=0.5),
    "top_k_top_p_temperature": dict(top_k=50, top_p=0.9, temperature=0.7),
    "min_p_top_k_top_p": dict(min_p=0.02, top_k=40, top_p=0.8, temperature=1.3),
    "allowed_ids": dict(allowed_token_ids=[3, 5, 7, 11, 200]),
    "bad_words": dict(bad_words=[[4], [1, 2], [9, 9, 8]]),
    "min_tokens": dict(min_tokens=3, stop_token_ids=[6, 10]),
    "logit_bias": dict(logit_bias={0: 5.0, 17: -100.0, 42: 2.5}),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "frequency_presence": dict(frequency_penalty=0.7, presence_penalty=-0.4),
    "all_penalties": dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
    "greedy": dict(temperature=0.0, top_k=3),
}

PROMPT = [1, 2, 3, 2, 9, 100, 101]
OUTPUT = [9, 1, 2, 9, 9, 9]


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square goodness of fit; bins expecting < 5 are pooled."""
    observed = observed.double()
    expected = probs.double() * observed.sum()
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] < min_expected:  # the pooled bin may itself be tiny: fold it into the largest
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        biggest = torch.argmax(exp)
        obs[biggest] += observed[small].sum()
        exp[biggest] += expected[small].sum()
    df = exp.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


class ConformanceSuite:
    """Contract checks for one backend; subclass as ``TestConformance`` and set ``backend``."""

    backend: Optional[str] = None
    vocab_size: int = 256
    #: rows per draw call and calls, for the chi-square tests (rows x calls draws)
    draw_rows: int = 1000
    draw_calls: int = 20
    #: smallest p-value accepted by the chi-square tests (fixed seeds make them repeatable)
    min_p_value: float = 1e-6

    # ------------------------------------------------------------------ fixtures
    def make_sampler(self) -> Sampler:
        from .. import get_sampler
        if self.backend is None:
            raise NotImplementedError("set `backend` or override make_sampler()")
        return get_sampler(self.backend)

    # Class-scoped fixtures are classmethods (pytest's rule); make_sampler stays an ordinary
    # method so subclasses override it naturally.
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls) -> Sampler:
        return cls().make_sampler()

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls) -> Sampler:
        return Sampler("cpu")

    # ------------------------------------------------------------------ helpers
    def build(self, sampler: Sampler, requests: Sequence[Request], eos_token_id=None,
              logprobs_mode="raw"):
        batch = sampler.new_batch(self.vocab_size, eos_token_id=eos_token_id,
                                  logprobs_mode=logprobs_mode)
        for rid, params, prompt, outputs in requests:
            batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
        return batch

    def logits(self, rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((rows, self.vocab_size), generator=gen) * scale

    @staticmethod
    def on(sampler: Sampler, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(sampler.device)

    @staticmethod
    def describe(batch, row: int) -> str:
        rid, child = batch.rows[row]
        return f"row {row} (request {rid!r}, child {child}, params {batch.params_of(rid)!r})"

    # ------------------------------------------------------------------ greedy
    def test_greedy_is_argmax_lowest_id_on_ties(self, sampler):
        logits = self.logits(6, seed=1)
        logits[2, 10] = logits[2, 20] = logits[2].max() + 1.0   # a tie: id 10 must win
        logits[4, :] = 0.5                                      # all tied: id 0
        requests = [(f"g{i}", SamplingParams(temperature=0.0), [], None) for i in range(6)]
        batch = self.build(sampler, requests)
        out = sampler.sample(self.on(sampler, logits), batch)
        got = out.token_ids.cpu()
        want = torch.argmax(logits, dim=-1)
        for row in range(6):
            assert got[row] == want[row], (
                f"greedy = argmax (lowest id on ties) broken at {self.describe(batch, row)}: "
                f"got {int(got[row])}, expected {int(want[row])}"
            )

    # ------------------------------------------------------------------ kept sets
    @pytest.mark.parametrize("case", sorted(STAGE_CASES))
    def test_kept_set_matches_reference(self, sampler, reference, case):
        params = SamplingParams(**STAGE_CASES[case])
        requests = [(f"r{i}", params, PROMPT, OUTPUT[: i + 1]) for i in range(4)]
        requests.append(("plain", SamplingParams(), PROMPT, OUTPUT))
        logits = self.logits(5, seed=zlib.crc32(case.encode()))
        if case == "top_k_ties":
            logits[0, :12] = 4.0   # twelve tokens tied at the top: all kept with top_k=5
        mine = self.build(sampler, requests, eos_token_id=6)
        ref = self.build(reference, requests, eos_token_id=6)
        got = sampler.processed_logits(self.on(sampler, logits), mine).cpu()
        want = reference.processed_logits(logits, ref)
        for row in range(len(requests)):
            kept_got, kept_want = torch.isfinite(got[row]), torch.isfinite(want[row])
            if not torch.equal(kept_got, kept_want):
                extra = torch.nonzero(kept_got & ~kept_want).flatten().tolist()[:10]
                missing = torch.nonzero(kept_want & ~kept_got).flatten().tolist()[:10]
                pytest.fail(f"stage {case!r}: kept set differs from the reference at "
                            f"{self.describe(mine, row)}: kept but should drop {extra}, "
                            f"dropped but should keep {missing}")
            torch.testing.assert_close(
                got[row][kept_want], want[row][kept_want], rtol=1e-5, atol=1e-5,
                msg=lambda m: f"stage {case!r}: kept logits differ at {self.describe(mine, row)}: {m}")

    # ------------------------------------------------------------------ draws
    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    def test_draws_follow_the_reference_distribution(self, sampler, reference, seeded):
        params = dict(temperature=0.9, top_k=60, top_p=0.95, min_p=0.001)
        logits = self.logits(1, seed=7, scale=1.5)
        probe = self.build(reference, [("p", SamplingParams(**params), [], None)])
        probs = torch.softmax(reference.processed_logits(logits, probe)[0], dim=-1)
        kept = probs > 0
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        torch.manual_seed(1234)
        for call in range(self.draw_calls):
            requests = [
                (f"d{call}-{i}", SamplingParams(**params, seed=(call * self.draw_rows + i) if seeded else None), [], None)
                for i in range(self.draw_rows)
            ]
            batch = self.build(sampler, requests)
            ids = sampler.sample(self.on(sampler, logits.expand(self.draw_rows, -1)), batch).token_ids.cpu()
            assert ((ids >= 0) & (ids < self.vocab_size)).all(), "token ids out of range"
            counts += torch.bincount(ids, minlength=self.vocab_size)
        never = torch.nonzero((counts > 0) & ~kept).flatten().tolist()
        assert not never, f"masked tokens were drawn: {never} (params {params})"
        p = chi_square_p_value(counts[kept], probs[kept])
        assert p > self.min_p_value, (
            f"draws do not follow the reference distribution (chi-square p={p:.2e}, "
            f"{counts.sum()} draws, seeded={seeded}, params {params})")

    def test_masked_tokens_never_drawn(self, sampler):
        allowed = [5, 6, 7, 8]
        params = SamplingParams(allowed_token_ids=allowed, bad_words=[[6]], temperature=2.0)
        requests = [(f"m{i}", params, [], None) for i in range(200)]
        batch = self.build(sampler, requests)
        logits = self.logits(1, seed=3).expand(200, -1)
        logits = logits.clone()
        logits[:, 6] = 50.0     # the banned word is by far the most likely token
        for _ in range(3):
            ids = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu()
            bad = [int(t) for t in ids if int(t) not in (5, 7, 8)]
            assert not bad, f"tokens outside allowed_ids minus bad_words were drawn: {bad[:10]}"

    # ------------------------------------------------------------------ seeds
    def _seeded_requests(self):
        return [
            ("s-plain", SamplingParams(seed=11), PROMPT, None),
            ("s-topk", SamplingParams(seed=12, top_k=30, temperature=0.8), PROMPT, None),
            ("s-topp", SamplingParams(seed=2**40 + 5, top_p=0.7), PROMPT, None),
            ("s-full", SamplingParams(seed=14, top_k=50, top_p=0.9, min_p=0.01, temperature=0.7,
                                      repetition_penalty=1.2, frequency_penalty=0.3,
                                      presence_penalty=0.2, logit_bias={3: 2.0}, min_tokens=2,
                                      stop_token_ids=[4], bad_words=[[1, 5]]), PROMPT, None),
            ("s-n3", SamplingParams(seed=15, n=3, temperature=1.1), PROMPT, None),
        ]

    def _run_steps(self, sampler, batch, steps: int, seed: int = 5, only: Optional[str] = None):
        """Sample ``steps`` steps; logits depend on (request, child, step) only. Returns
        {(request_id, child): [tokens]}."""
        tokens: dict = {}
        for step in range(steps):
            rows = []
            for rid, child in batch.rows:
                gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{child}/{step}/{seed}".encode()))
                rows.append(torch.randn(self.vocab_size, generator=gen) * 2.0)
            logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
            out = sampler.sample(self.on(sampler, logits), batch)
            ids = out.token_ids.cpu().tolist()
            for key, token in zip(batch.rows, ids):
                tokens.setdefault(key, []).append(token)
            batch.append(out.token_ids)
        return tokens

    def test_seeded_tokens_equal_the_reference(self, sampler, reference):
        requests = self._seeded_requests()
        got = self._run_steps(sampler, self.build(sampler, requests, eos_token_id=6), steps=6)
        want = self._run_steps(reference, self.build(reference, requests, eos_token_id=6), steps=6)
        for key in want:
            assert got[key] == want[key], (
                f"seeded tokens differ from the reference for request {key[0]!r} child {key[1]}: "
                f"got {got[key]}, reference {want[key]}")

    def test_seeded_tokens_independent_of_batch_composition(self, sampler):
        requests = self._seeded_requests()
        alone = {}
        for req in requests:
            alone.update(self._run_steps(sampler, self.build(sampler, [req]), steps=4))
        others = [(f"noise{i}", SamplingParams(temperature=1.5, top_k=7), [i], None) for i in range(5)]
        mixed_requests = others[:2] + list(reversed(requests)) + others[2:]
        mixed = self._run_steps(sampler, self.build(sampler, mixed_requests), steps=4)
        for key, tokens in alone.items():
            assert mixed[key] == tokens, (
                f"seeded request {key[0]!r} child {key[1]} drew {mixed[key]} in a mixed, "
                f"reordered batch but {tokens} alone")

    def test_children_draw_distinct_streams(self, sampler):
        params = SamplingParams(n=4, seed=99, temperature=1.0)
        batch = self.build(sampler, [("kids", params, [], None)])
        flat = torch.zeros(1, self.vocab_size)   # uniform: children differ unless streams repeat
        streams = {c: [] for c in range(4)}
        for _ in range(6):
            out = sampler.sample(self.on(sampler, flat), batch)   # one row per request
            for (rid, child), token in zip(batch.rows, out.token_ids.cpu().tolist()):
                streams[child].append(token)
            batch.append(out.token_ids)
        distinct = {tuple(s) for s in streams.values()}
        assert len(distinct) == 4, f"children of one request share a stream: {streams}"

    def test_child_zero_equals_single_completion(self, sampler):
        params = dict(seed=2024, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
        many = self._run_steps(sampler, self.build(sampler, [("r", SamplingParams(n=3, **params), PROMPT, None)]), steps=5)
        one = self._run_steps(sampler, self.build(sampler, [("r", SamplingParams(n=1, **params), PROMPT, None)]), steps=5)
        assert many[("r", 0)] == one[("r", 0)], (
            f"child 0 of n=3 drew {many[('r', 0)]}, the same request with n=1 drew {one[('r', 0)]}")

    def test_resume_matches_uninterrupted_run(self, sampler):
        params = SamplingParams(seed=5, temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5,
                                min_tokens=5, stop_token_ids=[1], bad_words=[[2, 3]], n=2)
        logits = self.logits(2, seed=8, scale=1.0)

        def run(interrupt: bool):
            batch = self.build(sampler, [("r", params, PROMPT, None)], eos_token_id=6)
            history = [[], []]
            for step in range(6):
                if interrupt and step == 3:
                    batch.remove("r")
                    batch.add("r", params, prompt_token_ids=PROMPT, output_token_ids=history)
                out = sampler.sample(self.on(sampler, logits), batch)
                for (rid, child), token in zip(batch.rows, out.token_ids.cpu().tolist()):
                    history[child].append(token)
                batch.append(out.token_ids)
            return history
        assert run(True) == run(False), "a resumed request drew other seeded tokens than an uninterrupted one"

    # ------------------------------------------------------------------ batch forms
    def test_per_request_logits_serve_all_children(self, sampler):
        requests = [("a", SamplingParams(n=3, seed=1), [], None), ("b", SamplingParams(seed=2), [], None),
                    ("c", SamplingParams(n=2, seed=3, top_k=5), [], None)]
        per_request = self.logits(3, seed=4)
        rows = self.build(sampler, requests)
        expanded = per_request[torch.tensor([0, 0, 0, 1, 2, 2])]
        got = sampler.sample(self.on(sampler, per_request), rows).token_ids.cpu()
        want = sampler.sample(self.on(sampler, expanded), self.build(sampler, requests)).token_ids.cpu()
        assert torch.equal(got, want), f"per-request logits gave {got.tolist()}, per-row {want.tolist()}"

    def test_mixed_greedy_and_random_rows(self, sampler, reference):
        requests = [("g", SamplingParams(temperature=0.0), PROMPT, None),
                    ("s", SamplingParams(seed=3, top_k=10), PROMPT, None),
                    ("u", SamplingParams(temperature=1.2, top_p=0.5), PROMPT, None),
                    ("g2", SamplingParams(temperature=0.0, repetition_penalty=1.5), PROMPT, OUTPUT)]
        logits = self.logits(4, seed=9)
        got = sampler.sample(self.on(sampler, logits), self.build(sampler, requests)).token_ids.cpu()
        want = reference.sample(logits, self.build(reference, requests)).token_ids
        for row in (0, 1, 3):
            assert got[row] == want[row], f"row {row} ({requests[row][0]}): got {int(got[row])}, reference {int(want[row])}"
        assert 0 <= int(got[2]) < self.vocab_size

    def test_caller_logits_are_not_modified(self, sampler):
        requests = [("a", SamplingParams(**STAGE_CASES["all_penalties"], top_k=3, logit_bias={1: 3.0},
                                         allowed_token_ids=[1, 2, 3, 4]), PROMPT, OUTPUT)]
        logits = self.on(sampler, self.logits(1, seed=2))
        before = logits.clone()
        sampler.sample(logits, self.build(sampler, requests))
        assert torch.equal(logits.cpu(), before.cpu()), "sample() modified the caller's logits"

    # ------------------------------------------------------------------ logprobs
    @pytest.mark.parametrize("mode", ["raw", "processed"])
    def test_logprobs_match_reference(self, sampler, reference, mode):
        requests = [("g", SamplingParams(temperature=0.0, logprobs=5), PROMPT, OUTPUT),
                    ("s", SamplingParams(seed=8, logprobs=2, top_k=20, temperature=0.8,
                                         repetition_penalty=1.3), PROMPT, OUTPUT),
                    ("z", SamplingParams(seed=9, logprobs=0, top_p=0.8), PROMPT, None)]
        logits = self.logits(3, seed=12)
        got = sampler.sample(self.on(sampler, logits), self.build(sampler, requests, logprobs_mode=mode))
        want = reference.sample(logits, self.build(reference, requests, logprobs_mode=mode))
        assert got.logprobs is not None, "logprobs were asked for but not returned"
        assert got.logprobs.token_ids.shape == (3, 6), f"logprobs width must be N+1=6, got {tuple(got.logprobs.token_ids.shape)}"
        widths = {"g": 6, "s": 3, "z": 1}
        for row, (rid, _, _, _) in enumerate(requests):
            w = widths[rid]
            g_ids, w_ids = got.logprobs.token_ids[row, :w].cpu(), want.logprobs.token_ids[row, :w]
            assert torch.equal(g_ids, w_ids), f"{mode} logprob token ids differ for {rid!r}: {g_ids.tolist()} vs {w_ids.tolist()}"
            torch.testing.assert_close(got.logprobs.logprobs[row, :w].cpu(), want.logprobs.logprobs[row, :w],
                                       rtol=1e-4, atol=1e-4)
            assert int(got.logprobs.ranks[row]) == int(want.logprobs.ranks[row]), f"{mode} rank differs for {rid!r}"

    # ------------------------------------------------------------------ bad rows
    def test_bad_rows_are_flagged_and_do_not_touch_others(self, sampler, reference):
        requests = [("ok", SamplingParams(seed=1, top_k=10), PROMPT, None),
                    ("nan", SamplingParams(seed=2), PROMPT, None),
                    ("masked", SamplingParams(seed=3, allowed_token_ids=[4], bad_words=[[4]]), PROMPT, None),
                    ("ok2", SamplingParams(temperature=0.0), PROMPT, None)]
        logits = self.logits(4, seed=13)
        logits[1, 7] = float("nan")
        got = sampler.sample(self.on(sampler, logits), self.build(sampler, requests))
        want = reference.sample(logits, self.build(reference, requests))
        valid = got.valid.cpu().tolist()
        assert valid == [True, False, False, True], f"valid flags {valid}, expected [True, False, False, True]"
        ids = got.token_ids.cpu().tolist()
        assert ids[1] == -1 and ids[2] == -1, f"flagged rows must return -1, got {ids}"
        assert ids[0] == int(want.token_ids[0]) and ids[3] == int(want.token_ids[3]), (
            f"a bad row changed other rows' tokens: {ids} vs reference {want.token_ids.tolist()}")
