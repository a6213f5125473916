"""The shared conformance suite: every backend against the reference backend.

Use it from a backend's own tests (one class, one line in it)::

    from corelib.testing import ConformanceSuite

    class TestConformance(ConformanceSuite):
        backend = "mybackend"            # a name corelib.get_sampler() accepts

or, without writing a file, ``pytest --pyargs corelib.testing.suite --corelib-backend NAME``.

Override ``make_sampler`` to build the sampler another way, set ``device`` to run the backend on
another device than its default (``"cuda:1"``), and size the statistical tests for a slow device
with the class attributes below. Every failure starts with the contract rule it breaks (the
step numbers of the contract's stage order) and names the row, its request and its parameters.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional, Sequence

import pytest
import torch

from ..params import SamplingParams
from ..sampler import Sampler
from .cases import STAGE_CASES, STAGE_RULES
from .engine import EngineConformance
from .fourth import FourthReleaseConformance
from .kept import KeptConformance
from .streams import SeedStreamConformance
from .verify import VerifyConformance
from .rules import OUTPUT, PROMPT, RULES, chi_square_p_value, params_text, violation

Request = tuple  # (request_id, SamplingParams, prompt_token_ids, output_token_ids or None)

class ConformanceSuite(KeptConformance, FourthReleaseConformance, VerifyConformance, EngineConformance,
                       SeedStreamConformance):
    """Contract checks for one backend; subclass as ``TestConformance`` and set ``backend``."""

    #: the backend's name as ``corelib.get_sampler`` takes it
    backend: Optional[str] = None
    #: a torch device for the backend (``"cuda:1"``); None = the backend's default device
    device: Optional[str] = None
    vocab_size: int = 256
    #: rows per draw call and calls, for the chi-square tests (rows x calls draws)
    draw_rows: int = 1000
    draw_calls: int = 20
    #: smallest p-value accepted by the chi-square tests (fixed seeds make them repeatable)
    min_p_value: float = 1e-6

    # ------------------------------------------------------------------ fixtures
    def make_sampler(self) -> Sampler:
        """The sampler under test; override to build it another way."""
        if self.backend is None:
            raise NotImplementedError("set `backend` or override make_sampler()")
        if self.device is None:
            from .. import get_sampler
            return get_sampler(self.backend)
        return self._sampler_on_device(self.backend, torch.device(self.device))

    @staticmethod
    def _sampler_on_device(name: str, device: torch.device) -> Sampler:
        from ..registry import default_registry
        status, _ = default_registry().choose(name)
        return status.spec.factory(device)

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
        """``row 2 (request 'r2', child 0, position 3, params SamplingParams(top_k=20))``."""
        rid, child = batch.rows[row]
        position = batch.generated_counts()[row]
        return (f"row {row} (request {rid!r}, child {child}, position {position}, "
                f"params {params_text(batch.params_of(rid))})")

    @staticmethod
    def describe_request(requests: Sequence[Request], rid: str, child: int = 0) -> str:
        params = next(p for r, p, _, _ in requests if r == rid)
        return f"request {rid!r} child {child} (params {params_text(params)})"

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
            if got[row] != want[row]:
                violation("greedy", f"at {self.describe(batch, row)}: got token {int(got[row])}, "
                                    f"expected {int(want[row])}")

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
        rule = STAGE_RULES[case]
        for row in range(len(requests)):
            kept_got, kept_want = torch.isfinite(got[row]), torch.isfinite(want[row])
            where = f"{self.describe(mine, row)}, prompt {PROMPT}, case {case!r}"
            if not torch.equal(kept_got, kept_want):
                extra = torch.nonzero(kept_got & ~kept_want).flatten().tolist()[:10]
                missing = torch.nonzero(kept_want & ~kept_got).flatten().tolist()[:10]
                violation(rule, f"kept set differs from the reference at {where}: kept but "
                                f"should drop {extra}, dropped but should keep {missing}")
            diff = (got[row][kept_want] - want[row][kept_want]).abs()
            tolerance = 1e-5 + 1e-5 * want[row][kept_want].abs()
            if diff.numel() and bool((diff > tolerance).any()):
                worst = int(torch.argmax(diff - tolerance))
                token = int(torch.nonzero(kept_want).flatten()[worst])
                violation(rule, f"kept logits differ from the reference at {where}: token {token} "
                                f"has {float(got[row, token]):.6g}, reference "
                                f"{float(want[row, token]):.6g} (tolerance 1e-5 abs + 1e-5 rel)")

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
        what = (f"{self.draw_rows} identical rows x {self.draw_calls} calls, "
                f"{'seeds 0..' + str(self.draw_rows * self.draw_calls - 1) if seeded else 'unseeded'}, "
                f"params {params_text(params)}")
        for call in range(self.draw_calls):
            requests = [
                (f"d{call}-{i}", SamplingParams(**params, seed=(call * self.draw_rows + i) if seeded else None), [], None)
                for i in range(self.draw_rows)
            ]
            batch = self.build(sampler, requests)
            ids = sampler.sample(self.on(sampler, logits.expand(self.draw_rows, -1)), batch).token_ids.cpu()
            bad = torch.nonzero((ids < 0) | (ids >= self.vocab_size)).flatten().tolist()
            if bad:
                violation("draw", f"token id {int(ids[bad[0]])} out of range [0, {self.vocab_size}) "
                                  f"at {self.describe(batch, bad[0])} (call {call})")
            dropped = torch.nonzero(~kept[ids]).flatten().tolist()
            if dropped:
                row = dropped[0]
                violation("draw", f"token {int(ids[row])}, which steps 10-13 drop, was drawn at "
                                  f"{self.describe(batch, row)} (call {call}; "
                                  f"{len(dropped)} such rows in this call)")
            counts += torch.bincount(ids, minlength=self.vocab_size)
        p = chi_square_p_value(counts[kept], probs[kept])
        if not p > self.min_p_value:
            worst = torch.argmax((counts - probs * counts.sum()).abs())
            violation("draw", f"draws do not follow the reference distribution (chi-square "
                              f"p={p:.2e} < {self.min_p_value:.0e}; {int(counts.sum())} draws of "
                              f"{what}; token {int(worst)} drawn {int(counts[worst])} times, "
                              f"expected {float(probs[worst] * counts.sum()):.1f})")

    def test_masked_tokens_never_drawn(self, sampler):
        allowed = [5, 6, 7, 8]
        params = SamplingParams(allowed_token_ids=allowed, bad_words=[[6]], temperature=2.0)
        requests = [(f"m{i}", params, [], None) for i in range(200)]
        batch = self.build(sampler, requests)
        logits = self.logits(1, seed=3).expand(200, -1)
        logits = logits.clone()
        logits[:, 6] = 50.0     # the banned word is by far the most likely token
        for step in range(3):
            ids = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu().tolist()
            bad = [row for row, t in enumerate(ids) if t not in (5, 7, 8)]
            if bad:
                violation("masks", f"token {ids[bad[0]]} drawn at {self.describe(batch, bad[0])} "
                                   f"(step {step}); only 5, 7, 8 may be drawn; "
                                   f"{len(bad)} of 200 rows broke the rule")
            batch.append(torch.tensor(ids))

    # ------------------------------------------------------------------ batch forms
    def test_per_request_logits_serve_all_children(self, sampler):
        requests = [("a", SamplingParams(n=3, seed=1), [], None), ("b", SamplingParams(seed=2), [], None),
                    ("c", SamplingParams(n=2, seed=3, top_k=5), [], None)]
        per_request = self.logits(3, seed=4)
        rows = self.build(sampler, requests)
        expanded = per_request[torch.tensor([0, 0, 0, 1, 2, 2])]
        got = sampler.sample(self.on(sampler, per_request), rows).token_ids.cpu()
        want = sampler.sample(self.on(sampler, expanded), self.build(sampler, requests)).token_ids.cpu()
        for row in range(len(want)):
            if got[row] != want[row]:
                violation("per_request", f"at {self.describe(rows, row)}: logits [3, V] (one row "
                                         f"per request) gave token {int(got[row])}, the same "
                                         f"logits expanded to [6, V] gave {int(want[row])}")

    def test_mixed_greedy_and_random_rows(self, sampler, reference):
        requests = [("g", SamplingParams(temperature=0.0), PROMPT, None),
                    ("s", SamplingParams(seed=3, top_k=10), PROMPT, None),
                    ("u", SamplingParams(temperature=1.2, top_p=0.5), PROMPT, None),
                    ("g2", SamplingParams(temperature=0.0, repetition_penalty=1.5), PROMPT, OUTPUT)]
        logits = self.logits(4, seed=9)
        batch = self.build(sampler, requests)
        got = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu()
        ref = self.build(reference, requests)
        want = reference.sample(logits, ref).token_ids
        kept = torch.isfinite(reference.processed_logits(logits, self.build(reference, requests)))
        for row in (0, 1, 3):
            if got[row] != want[row]:
                rule = "seed_reference" if row == 1 else "greedy_prep"
                violation(rule, f"in a batch mixing greedy and random rows, {self.describe(batch, row)} "
                                f"got token {int(got[row])}, reference {int(want[row])}")
        token = int(got[2])
        if not (0 <= token < self.vocab_size and bool(kept[2, token])):
            violation("draw", f"in a batch mixing greedy and random rows, {self.describe(batch, 2)} "
                              f"drew token {token}, which top_p drops")

    def test_caller_logits_are_not_modified(self, sampler):
        params = SamplingParams(**STAGE_CASES["penalties"], top_k=3, logit_bias={1: 3.0},
                                allowed_token_ids=[1, 2, 3, 4])
        requests = [("a", params, PROMPT, OUTPUT)]
        logits = self.on(sampler, self.logits(1, seed=2))
        before = logits.clone()
        sampler.sample(logits, self.build(sampler, requests))
        if not torch.equal(logits.cpu(), before.cpu()):
            changed = torch.nonzero(logits.cpu() != before.cpu())[:, 1].tolist()[:10]
            violation("copy", f"sample() modified the caller's logits at token ids {changed} "
                              f"(row 0, request 'a', params {params_text(params)})")

    @pytest.mark.parametrize("rows", [1, 2, 5])
    def test_outputs_belong_to_the_caller(self, sampler, rows):
        kinds = [SamplingParams(seed=41, top_k=3, logprobs=2, return_kept=True),
                 SamplingParams(temperature=0.0, logprobs=2, return_kept=True),
                 SamplingParams(seed=43, top_p=0.8, min_p=0.02, logprobs=2, return_kept=True),
                 SamplingParams(top_k=5, logprobs=2),
                 SamplingParams(seed=45, logprobs=2, return_kept=True)]
        requests = [(f"r{i}", kinds[i], PROMPT, None) for i in range(rows)]
        batch = self.build(sampler, requests)
        held: dict[str, torch.Tensor] = {}
        out = sampler.sample(self.on(sampler, self.logits(rows, seed=5)), batch)
        held.update(output_tensors("sample", out))
        batch.append(out.token_ids)
        drafts = self.on(sampler, torch.tensor([[3, 4]] * rows))
        out = sampler.verify(self.on(sampler, self.logits(rows * 3, seed=6).view(rows, 3, -1)), batch, drafts)
        held.update(output_tensors("verify", out))
        batch.append(out.token_ids)
        held.update(output_tensors("score", sampler.score(
            self.on(sampler, self.logits(rows, seed=7)), batch, self.on(sampler, torch.arange(rows)))))
        copies = {name: t.detach().cpu().clone() for name, t in held.items()}
        for seed in (8, 9):
            logits = -self.logits(rows, seed=seed)
            logits[0, 1] = float("nan") if seed == 9 else logits[0, 1]   # a flagged row too
            out = sampler.sample(self.on(sampler, logits), batch)
            batch.append(out.token_ids)
        for name, tensor in held.items():
            if not same_values(tensor.cpu(), copies[name]):
                violation("outputs", f"{name} changed after two more steps ({rows} rows: "
                                     f"{', '.join(params_text(p) for p in kinds[:rows])})")

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
    def test_low_precision_logits(self, sampler, reference, dtype):
        requests = [("g", SamplingParams(temperature=0.0, repetition_penalty=1.2), PROMPT, OUTPUT),
                    ("s", SamplingParams(seed=21, top_k=40, top_p=0.9), PROMPT, None)]
        logits = self.logits(2, seed=14).to(dtype)
        batch = self.build(sampler, requests)
        got = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu()
        want = reference.sample(logits, self.build(reference, requests)).token_ids
        for row in range(2):
            if got[row] != want[row]:
                violation("dtype", f"{dtype} logits: {self.describe(batch, row)} got token "
                                   f"{int(got[row])}, reference {int(want[row])}")

    # ------------------------------------------------------------------ logprobs
    @pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
    def test_logprobs_match_reference(self, sampler, reference, mode):
        requests = [("g", SamplingParams(temperature=0.0, logprobs=5), PROMPT, OUTPUT),
                    ("s", SamplingParams(seed=8, logprobs=2, top_k=20, temperature=0.8,
                                         repetition_penalty=1.3), PROMPT, OUTPUT),
                    ("z", SamplingParams(seed=9, logprobs=0, top_p=0.8), PROMPT, None)]
        logits = self.logits(3, seed=12)
        batch = self.build(sampler, requests, logprobs_mode=mode)
        got = sampler.sample(self.on(sampler, logits), batch)
        want = reference.sample(logits, self.build(reference, requests, logprobs_mode=mode))
        if got.logprobs is None:
            violation("logprobs", f"logprobs were asked for (up to 5, mode {mode!r}) but "
                                  f"sample() returned none")
        shape = tuple(got.logprobs.token_ids.shape)
        if shape != (3, 6):
            violation("logprobs", f"logprobs token_ids must be [rows, N+1] = (3, 6) for N=5, got {shape}")
        widths = {"g": 6, "s": 3, "z": 1}
        for row, (rid, _, _, _) in enumerate(requests):
            w = widths[rid]
            where = f"{self.describe(batch, row)}, mode {mode!r}"
            g_ids, w_ids = got.logprobs.token_ids[row, :w].cpu(), want.logprobs.token_ids[row, :w]
            if not torch.equal(g_ids, w_ids):
                violation("logprobs", f"token ids (sampled, then top-{w - 1}) differ at {where}: "
                                      f"{g_ids.tolist()}, reference {w_ids.tolist()}")
            g_lp, w_lp = got.logprobs.logprobs[row, :w].cpu(), want.logprobs.logprobs[row, :w]
            if not torch.allclose(g_lp, w_lp, rtol=1e-4, atol=1e-4):
                violation("logprobs", f"logprob values differ at {where}: {g_lp.tolist()}, "
                                      f"reference {w_lp.tolist()} (tolerance 1e-4)")
            g_rank, w_rank = int(got.logprobs.ranks[row]), int(want.logprobs.ranks[row])
            if g_rank != w_rank:
                violation("logprobs", f"rank of the sampled token differs at {where}: {g_rank}, "
                                      f"reference {w_rank}")

    @pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
    def test_many_and_all_logprobs_match_reference(self, sampler, reference, mode):
        V = self.vocab_size
        requests = [("all", SamplingParams(seed=3, logprobs=-1, top_k=50, temperature=0.8), PROMPT, OUTPUT),
                    ("many", SamplingParams(temperature=0.0, logprobs=40, presence_penalty=1.0), PROMPT, OUTPUT),
                    ("few", SamplingParams(seed=4, logprobs=2, top_p=0.9), PROMPT, None)]
        logits = self.logits(3, seed=15)
        batch = self.build(sampler, requests, logprobs_mode=mode)
        got = sampler.sample(self.on(sampler, logits), batch)
        want = reference.sample(logits, self.build(reference, requests, logprobs_mode=mode))
        if got.logprobs is None or tuple(got.logprobs.token_ids.shape) != (3, V + 1):
            shape = None if got.logprobs is None else tuple(got.logprobs.token_ids.shape)
            violation("logprobs", f"logprobs=-1 asks for every token: token_ids must be [rows, V+1] = "
                                  f"{(3, V + 1)}, got {shape} (mode {mode!r})")
        for row, width in enumerate((V + 1, 41, 3)):
            where = f"{self.describe(batch, row)}, mode {mode!r}"
            g_lp, w_lp = got.logprobs.logprobs[row, :width].cpu(), want.logprobs.logprobs[row, :width]
            if not torch.allclose(g_lp, w_lp, rtol=1e-4, atol=1e-4):
                violation("logprobs", f"the {width - 1} top values differ at {where}: "
                                      f"{g_lp.tolist()[:8]}..., reference {w_lp.tolist()[:8]}...")
            finite = torch.isfinite(w_lp)       # tokens tied at -inf may come in any order
            g_ids, w_ids = got.logprobs.token_ids[row, :width].cpu(), want.logprobs.token_ids[row, :width]
            if not torch.equal(g_ids[finite], w_ids[finite]):
                violation("logprobs", f"token ids of the top {width - 1} differ at {where}")
            if int(got.logprobs.ranks[row]) != int(want.logprobs.ranks[row]):
                violation("logprobs", f"rank of the sampled token differs at {where}")
        if bool((got.logprobs.logprobs[0, 1:-1].cpu() < got.logprobs.logprobs[0, 2:].cpu()).any()):
            violation("logprobs", f"logprobs=-1: columns 1..V must be in descending order (mode {mode!r})")

    @pytest.mark.parametrize("mode", ["raw", "processed"])
    def test_top_logprobs_list_equal_values_in_id_order(self, sampler, mode):
        V = self.vocab_size
        gen = torch.Generator().manual_seed(23)
        # whole numbers: equal logits have equal logprobs, different ones never round together
        logits = torch.randint(-6, 7, (3, V), generator=gen).float()
        logits[:, [200 % V, 13, 77 % V, 5]] = 9.0           # a tie at the top
        logits[:, [150 % V, 9, 60 % V, 31, 240 % V]] = 8.0   # a tie across the 6th place
        requests = [("g", SamplingParams(temperature=0.0, logprobs=6), PROMPT, None),
                    ("k", SamplingParams(seed=5, top_k=3, logprobs=12), PROMPT, None),
                    ("all", SamplingParams(seed=6, top_k=40, logprobs=-1), PROMPT, None)]
        batch = self.build(sampler, requests, logprobs_mode=mode)
        out = sampler.sample(self.on(sampler, logits), batch)
        for row, (rid, params, _, _) in enumerate(requests):
            width = V if params.logprobs == -1 else params.logprobs
            value = logits[row].tolist()
            if mode == "processed" and params.top_k:     # the kept set (ties kept), the rest -inf
                kth = sorted(value, reverse=True)[params.top_k - 1]
                value = [v if v >= kth else float("-inf") for v in value]
            want = sorted(range(V), key=lambda i: (-value[i], i))[:width]
            got = out.logprobs.token_ids[row, 1:width + 1].cpu().tolist()
            if got != want:
                first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                violation("logprobs", f"top-{width} of {self.describe(batch, row)}, mode {mode!r}: "
                                      f"place {first + 1} holds id {got[first]}, the order (best "
                                      f"first, equal values by increasing id) puts {want[first]} "
                                      f"there (got {got[max(0, first - 2):first + 3]}, want "
                                      f"{want[max(0, first - 2):first + 3]})")

    def test_logprobs_beyond_the_vocabulary_raise_at_add(self, sampler):
        batch = self.build(sampler, [])
        try:
            batch.add("big", SamplingParams(logprobs=self.vocab_size + 1))
        except ValueError as exc:
            if "logprobs" not in str(exc):
                violation("logprobs", f"logprobs=V+1 raised {exc!r}, which does not name logprobs")
        else:
            violation("logprobs", f"logprobs={self.vocab_size + 1} exceeds vocab_size={self.vocab_size} "
                                  f"and must raise ValueError at add")

    # ------------------------------------------------------------------ bad rows
    def test_bad_rows_are_flagged_and_do_not_touch_others(self, sampler, reference):
        requests = [("ok", SamplingParams(seed=1, top_k=10), PROMPT, None),
                    ("nan", SamplingParams(seed=2), PROMPT, None),
                    ("masked", SamplingParams(seed=3, allowed_token_ids=[4], bad_words=[[4]]), PROMPT, None),
                    ("ok2", SamplingParams(temperature=0.0), PROMPT, None)]
        logits = self.logits(4, seed=13)
        logits[1, 7] = float("nan")
        batch = self.build(sampler, requests)
        got = sampler.sample(self.on(sampler, logits), batch)
        want = reference.sample(logits, self.build(reference, requests))
        valid = got.valid.cpu().tolist()
        ids = got.token_ids.cpu().tolist()
        why = {1: "a NaN logit", 2: "every token masked by allowed_token_ids and bad_words"}
        for row, expected in enumerate([True, False, False, True]):
            if valid[row] != expected:
                violation("bad_rows", f"valid flag {valid[row]} at {self.describe(batch, row)}"
                                      + (f" with {why[row]}" if row in why else "")
                                      + f"; expected {expected} (all flags {valid})")
        for row in (1, 2):
            if ids[row] != -1:
                violation("bad_rows", f"flagged {self.describe(batch, row)} with {why[row]} "
                                      f"returned token {ids[row]}, expected -1")
        for row in (0, 3):
            if ids[row] != int(want.token_ids[row]):
                violation("bad_rows", f"a bad row changed {self.describe(batch, row)}: token "
                                      f"{ids[row]}, reference {int(want.token_ids[row])}")

    @pytest.mark.parametrize("how", ["nan", "bitmask"])
    def test_a_flagged_row_appended_as_minus_one_changes_nothing(self, sampler, how):
        flagged = SamplingParams(seed=31, temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0,
                                 repetition_penalty=1.3, min_tokens=3, stop_token_ids=[5],
                                 dry_multiplier=2.0, dry_allowed_length=1, bad_words=[[9, 1]])
        requests = [("f", flagged, PROMPT, None), ("o", SamplingParams(seed=32, top_k=30), PROMPT, None)]
        steps = [self.logits(2, seed=40 + step, scale=1.0) for step in range(6)]
        width = (self.vocab_size + 31) // 32
        no_token = torch.full((2, width), -1, dtype=torch.int32)
        no_token[0] = 0                                  # row 0 ("f") may draw nothing

        def run(flag_step, skip_step=None):
            batch = self.build(sampler, requests, eos_token_id=6)
            tokens = {"f": [], "o": []}
            for step, logits in enumerate(steps):
                if step == skip_step:
                    continue
                mask = None
                if step == flag_step:
                    logits = logits.clone()
                    if how == "nan":
                        logits[0, 3] = float("nan")
                    else:
                        mask = self.on(sampler, no_token)
                out = sampler.sample(self.on(sampler, logits), batch, token_bitmask=mask)
                batch.append(out.token_ids)                 # the plain loop: no filtering
                for (rid, _), token in zip(batch.rows, out.token_ids.cpu().tolist()):
                    tokens[rid].append(token)
            return tokens, batch.generated_counts()

        with_flag, counts = run(flag_step=2)
        never_saw_it, counts_without = run(flag_step=None, skip_step=2)
        no_flag, _ = run(flag_step=None)
        why = "NaN logits" if how == "nan" else "a token bitmask that leaves it no token"
        if with_flag["f"][2] != -1:
            violation("bad_rows", f"request 'f' (params {params_text(flagged)}) with {why} at step 2 "
                                  f"returned token {with_flag['f'][2]}, expected -1")
        got = with_flag["f"][:2] + with_flag["f"][3:]
        if got != never_saw_it["f"]:
            violation("flagged_append", f"request 'f' (params {params_text(flagged)}, prompt {PROMPT}, "
                                        f"eos 6) flagged at step 2 by {why} and appended as -1 then "
                                        f"drew {got}; a batch that never saw that step drew "
                                        f"{never_saw_it['f']} ({self._first_difference(got, never_saw_it['f'])})")
        if counts[0] != counts_without[0]:
            violation("flagged_append", f"request 'f' has {counts[0]} generated tokens after a flagged "
                                        f"step appended as -1; expected {counts_without[0]}")
        if with_flag["o"] != no_flag["o"]:
            violation("bad_rows", f"request 'o' drew {with_flag['o']} beside a row flagged at step 2, "
                                  f"{no_flag['o']} without it")

    def test_append_rejects_other_out_of_range_host_ids(self, sampler):
        batch = self.build(sampler, [("a", SamplingParams(), PROMPT, None),
                                     ("b", SamplingParams(presence_penalty=1.0), PROMPT, None)])
        for bad in (self.vocab_size, -2):
            try:
                batch.append([3, bad])
            except ValueError as exc:
                if "row 1" not in str(exc):
                    violation("flagged_append", f"append([3, {bad}]) raised {exc!r}, which does not "
                                                f"name row 1")
            else:
                violation("flagged_append", f"append([3, {bad}]) on the host accepted id {bad}; only "
                                            f"-1 (no token) may lie outside [0, {self.vocab_size})")
        if batch.generated_counts() != [0, 0]:
            violation("flagged_append", f"a refused append changed the generated counts to "
                                        f"{batch.generated_counts()}")


def output_tensors(call: str, out) -> dict[str, torch.Tensor]:
    """Every tensor of an output (``SamplerOutput``, ``VerifyOutput``, ``ScoreOutput``, with
    their ``Logprobs``) by a name such as ``"sample: out.logprobs.ranks"``."""
    found: dict[str, torch.Tensor] = {}
    for field in dataclasses.fields(out):
        value = getattr(out, field.name)
        if isinstance(value, torch.Tensor):
            found[f"{call}: out.{field.name}"] = value
        elif dataclasses.is_dataclass(value):
            for name, tensor in output_tensors(call, value).items():
                found[name.replace("out.", f"out.{field.name}.", 1)] = tensor
    return found


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN (a verify slot that emitted nothing)."""
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)
