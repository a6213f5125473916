"""The conformance suite's checks of kept sets and ``score`` (the contract's "Kept sets and
scoring"): the kept set each step returns, per slot in ``verify``, and teacher forcing through
the same pipeline, bitwise against what ``sample`` reported. Mixed into ``ConformanceSuite``,
so every backend (third-party ones included) proves them.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from ..bitmask import pack_bitmask, unpack_bitmask
from ..params import SamplingParams
from .cases import STAGE_CASES
from .rules import PROMPT, violation

NEG_INF = float("-inf")
THINK = dict(thinking_start_token_ids=[200], thinking_end_token_ids=[201])


def kept_requests(vocab_size: int) -> list[tuple]:
    """One seeded request per stage of the table (its example) and per combination of the
    suite, every one asking for its kept set; then a greedy row, a row forced by the reasoning
    budget, and a row that does not ask."""
    requests = [(f"k-{name}", SamplingParams(**{"seed": 100 + i, **params, "return_kept": True, "logprobs": -1}), PROMPT, None)
                for i, (name, params) in enumerate(sorted(STAGE_CASES.items()))]
    requests += [
        ("k-argmax", SamplingParams(temperature=0.0, repetition_penalty=1.2, return_kept=True, logprobs=-1), PROMPT, None),
        ("k-forced", SamplingParams(seed=7, top_k=30, thinking_budget=0, return_kept=True, logprobs=-1, **THINK),
         PROMPT + [200], None),
        ("k-silent", SamplingParams(seed=8, top_p=0.5, logprobs=-1), PROMPT, None),
    ]
    return requests


# The rows a rollout and its scoring share: every filter, a selector each, greedy, DRY and
# penalties that move with the tokens, a reasoning budget; seeded so the rollout is repeatable.
SCORED = (
    ("filters", dict(top_k=40, top_p=0.9, min_p=0.02, temperature=0.8, seed=11)),
    ("penalties", dict(repetition_penalty=1.3, frequency_penalty=0.4, dry_multiplier=0.8,
                       dry_allowed_length=1, temperature=1.2, seed=12)),
    ("greedy", dict(temperature=0.0, presence_penalty=0.5)),
    ("new", dict(dynatemp_range=0.4, smoothing_factor=0.2, top_a=0.02, eta_cutoff=0.002,
                 tfs=0.97, p_less="norm", typical_p=0.95, xtc_probability=0.5, xtc_threshold=0.05,
                 seed=13)),
    ("mirostat", dict(mirostat_tau=4.0, mirostat_eta=0.2, min_p=0.01, seed=14)),
    ("adaptive", dict(adaptive_p_target=0.3, top_k=50, seed=15)),
    ("thinking", dict(thinking_budget=1, top_k=20, seed=16, **THINK)),
    ("order", dict(temperature=0.6, top_k=30, min_p=0.05, seed=17,
                   sampler_order=["min_p", "temperature", "top_k"])),
)


class KeptConformance:
    """Kept sets and ``score``; ``ConformanceSuite`` supplies the fixtures and helpers."""

    #: positions of the rollouts ``score`` is checked on
    score_steps: int = 5

    # ------------------------------------------------------------------ the kept set
    def test_kept_set_is_the_distribution_the_row_drew_from(self, sampler):
        requests = kept_requests(self.vocab_size)
        batch = self.build(sampler, requests, logprobs_mode="processed_logits")
        B, V = len(requests), self.vocab_size
        logits = self.logits(B, seed=31)
        logits[B - 3, :100] += 4.0       # the greedy row's argmax among the first tokens
        # a grammar mask on one row, so the kept set shows it
        allowed = torch.ones(B, V, dtype=torch.bool)
        allowed[0, 1::2] = False
        bitmask = pack_bitmask(allowed)
        out = sampler.sample(self.on(sampler, logits), batch, token_bitmask=self.on(sampler, bitmask))
        if out.kept is None or tuple(out.kept.shape) != (B, (V + 31) // 32) or out.kept.dtype != torch.int32:
            violation("kept", f"out.kept is {None if out.kept is None else (out.kept.dtype, list(out.kept.shape))}, "
                              f"not int32 [{B}, {(V + 31) // 32}]")
        kept = unpack_bitmask(out.kept.cpu(), V)
        ids = out.token_ids.cpu()
        # logprobs_mode processed_logits with every token: the finite ones are the kept set
        processed = torch.full((B, V), NEG_INF)
        processed.scatter_(1, out.logprobs.token_ids[:, 1:].cpu().clamp(min=0), out.logprobs.logprobs[:, 1:].cpu())
        for row, (rid, params, _, _) in enumerate(requests):
            where = self.describe(batch, row)
            got = kept[row]
            if rid == "k-silent":
                want = torch.zeros(V, dtype=torch.bool)
            elif params.is_greedy:
                want = torch.arange(V) == ids[row]
            else:
                want = torch.isfinite(processed[row])
            if rid == "k-forced" and got.nonzero().flatten().tolist() != [201]:
                violation("kept", f"a row forced by its reasoning budget kept "
                                  f"{got.nonzero().flatten().tolist()[:8]}, not the forced token 201 at {where}")
            if not torch.equal(got, want):
                violation("kept", f"kept set of {int(got.sum())} tokens, the distribution drawn from "
                                  f"has {int(want.sum())} (first difference at token "
                                  f"{int((got != want).nonzero()[0])}) at {where}")
            if rid != "k-silent" and not bool(got[ids[row]]):
                violation("kept", f"the drawn token {int(ids[row])} is not in the kept set at {where}")
        if bool(kept[0, 1::2].any()):
            violation("kept", f"a token the grammar bitmask forbids is in the kept set at {self.describe(batch, 0)}")
        words = out.kept.cpu()
        if V % 32 and bool((words[:, -1] >> (V % 32)).any()):
            violation("kept", "bits for ids >= V are set")

    def test_kept_set_of_a_flagged_row_is_empty_and_none_when_no_row_asks(self, sampler):
        batch = self.build(sampler, [("bad", SamplingParams(seed=1, return_kept=True), [], None),
                                     ("good", SamplingParams(seed=2, top_k=5, return_kept=True), [], None)])
        logits = self.logits(2, seed=5)
        logits[0, 3] = float("nan")
        out = sampler.sample(self.on(sampler, logits), batch)
        kept = unpack_bitmask(out.kept.cpu(), self.vocab_size)
        if bool(kept[0].any()) or int(kept[1].sum()) != 5:
            violation("kept", f"a flagged row kept {int(kept[0].sum())} tokens (none), its neighbour "
                              f"with top_k=5 kept {int(kept[1].sum())}")
        plain = self.build(sampler, [("p", SamplingParams(seed=1, top_k=5), [], None)])
        if sampler.sample(self.on(sampler, self.logits(1, seed=5)), plain).kept is not None:
            violation("kept", "out.kept is not None although no row asked for it")

    @pytest.mark.parametrize("method", ["token", "block"])
    def test_verify_returns_each_slots_kept_set(self, sampler, reference, method):
        requests = [("v-seeded", SamplingParams(seed=21, top_k=20, top_p=0.9, return_kept=True), PROMPT, None),
                    ("v-greedy", SamplingParams(temperature=0.0, return_kept=True), PROMPT, None),
                    ("v-silent", SamplingParams(seed=22, min_p=0.1), PROMPT, None)]
        K, V = 3, self.vocab_size
        gen = torch.Generator().manual_seed(9)
        logits = torch.randn((3, K + 1, V), generator=gen) * 2
        drafts = torch.stack([logits[r, :K].argmax(-1) for r in range(3)])   # likely accepted
        probs = torch.softmax(torch.randn((3, K, V), generator=gen), dim=-1)
        outs = []
        for s in (sampler, reference):
            batch = self.build(s, requests)
            outs.append(s.verify(self.on(s, logits), batch, self.on(s, drafts),
                                 self.on(s, probs), method=method))
        got, want = outs
        if got.kept is None or tuple(got.kept.shape) != (3, K + 1, (V + 31) // 32):
            violation("kept", f"verify's kept is {None if got.kept is None else list(got.kept.shape)}, "
                              f"not [3, {K + 1}, {(V + 31) // 32}]")
        emitted = got.num_emitted.cpu()
        kept = unpack_bitmask(got.kept.cpu(), V)
        for row in range(2):
            n = int(emitted[row])
            if bool(kept[row, n:].any()):
                violation("kept", f"verify: request {requests[row][0]!r} reached {n} slots but slot "
                                  f"{n + int(kept[row, n:].any(-1).nonzero()[0])} has a kept set")
            for j in range(n):     # accepted drafts and residual draws lie where p > 0
                if not bool(kept[row, j, got.token_ids[row, j].cpu()]):
                    violation("kept", f"verify: the token emitted at slot {j} of request "
                                      f"{requests[row][0]!r} is outside that slot's kept set")
        if not torch.equal(got.num_emitted.cpu(), want.num_emitted) or not torch.equal(got.kept.cpu(), want.kept):
            violation("kept", f"verify ({method}): the kept sets differ from the reference's on seeded and "
                              f"greedy rows (emitted {got.num_emitted.tolist()}, reference "
                              f"{want.num_emitted.tolist()})")
        if bool(kept[2].any()):
            violation("kept", "verify: a row that did not ask has a kept set")

    def test_kept_set_and_score_cover_custom_stages(self, sampler, reference, conformance_stages):
        # a plugin's after_filters stage truncates, and its after_penalties stage bans a token
        # generated once: the kept set shows both, and score follows the stage's state
        args = {"conformance-floor": {"prob": 0.03}, "conformance-ban-repeats": {"times": 1}}
        requests = [("custom", SamplingParams(seed=71, top_k=60, stage_args=args, logprobs=0,
                                              return_kept=True), PROMPT, [3]),
                    ("plain", SamplingParams(seed=72, top_k=60, logprobs=0, return_kept=True), PROMPT, [3])]
        outs = {}
        for s in (sampler, reference):
            batch = self.build(s, requests, logprobs_mode="processed")
            tokens, logprobs, kept = [], [], []
            for step in range(3):
                out = s.sample(self.on(s, self.logits(2, seed=80 + step)), batch)
                tokens.append(out.token_ids.cpu())
                logprobs.append(out.logprobs.logprobs[:, 0].cpu())
                kept.append(out.kept.cpu())
                batch.append(out.token_ids)
            outs[s.name] = torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(kept, 1)
        tokens, logprobs, kept = outs[sampler.name]
        if not torch.equal(kept, outs[reference.name][2]):
            violation("kept", "with custom stages, the kept sets differ from the reference's")
        sets = unpack_bitmask(kept, self.vocab_size)
        if bool(sets[0, :, 3].any()):
            violation("kept", "token 3, which the custom ban-repeats stage bans, is in the kept set")
        if not bool((sets[0].sum(-1) < sets[1].sum(-1)).all()):
            violation("kept", "the custom floor stage did not shrink the kept set")
        logits = torch.stack([self.logits(2, seed=80 + step) for step in range(3)], 1)
        out, back, _ = self._score(sampler, requests, [0, 1], logits, tokens)
        if not torch.equal(out.logprobs.cpu()[back], logprobs):
            violation("score", "with custom stages, score differs from what sample reported")

    # ------------------------------------------------------------------ score
    def _rollout(self, sampler, order: Sequence[int], seed: int = 41):
        """Sample ``score_steps`` steps of the SCORED requests (in batch order ``order``),
        appending each; returns (logits [R, T, V] per request in SCORED order, tokens [R, T],
        processed logprobs [R, T], kept [R, T, W])."""
        requests = [(name, SamplingParams(**params, logprobs=0, return_kept=True), PROMPT + [7], None)
                    for name, params in SCORED]
        batch = self.build(sampler, [requests[i] for i in order], logprobs_mode="processed")
        R, T, V = len(requests), self.score_steps, self.vocab_size
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn((R, T, V), generator=gen) * 2.5
        logits[:, :, 200] += 3.0      # the thinking row may enter and leave its budget
        tokens = torch.zeros((R, T), dtype=torch.long)
        logprobs = torch.zeros((R, T))
        kept = torch.zeros((R, T, (V + 31) // 32), dtype=torch.int32)
        index = torch.tensor(order)
        for t in range(T):
            out = sampler.sample(self.on(sampler, logits[index, t]), batch)
            tokens[index, t] = out.token_ids.cpu()
            logprobs[index, t] = out.logprobs.logprobs[:, 0].cpu()
            kept[index, t] = out.kept.cpu()
            batch.append(out.token_ids)
        return requests, logits, tokens, logprobs, kept

    def _score(self, sampler, requests, order, logits, tokens, kept=None, grad=False):
        batch = self.build(sampler, [requests[i] for i in order])
        index = torch.tensor(order)
        x = self.on(sampler, logits[index])
        if grad:
            x.requires_grad_()
        out = sampler.score(x, batch, self.on(sampler, tokens[index]),
                            None if kept is None else self.on(sampler, kept[index]))
        back = torch.argsort(index)
        return out, back, x

    @pytest.mark.parametrize("composition", ["same", "reversed", "with_others"])
    def test_score_equals_the_processed_logprob_sample_reported(self, sampler, composition):
        R = len(SCORED)
        requests, logits, tokens, logprobs, _ = self._rollout(sampler, list(range(R)))
        order = {"same": list(range(R)), "reversed": list(reversed(range(R))),
                 "with_others": [3, 0, 5, 1, 7, 2, 6, 4]}[composition]
        out, back, _ = self._score(sampler, requests, order, logits, tokens)
        got = out.logprobs.detach().cpu()[back]
        for row, (name, _) in enumerate(SCORED):
            same = torch.equal(got[row], logprobs[row])
            if not same:
                t = int((got[row] != logprobs[row]).nonzero()[0])
                violation("score", f"request {name!r} ({composition} batch): score gives "
                                   f"{got[row, t].item()!r} at position {t} for token {int(tokens[row, t])}, "
                                   f"sample reported {logprobs[row, t].item()!r} (bitwise on one backend)")
            if not bool(out.kept_token.cpu()[back][row].all()) or not bool(out.valid.cpu()[back][row].all()):
                violation("score", f"request {name!r}: a token sample drew is not kept_token/valid in score")

    def test_score_over_positions_equals_single_steps_with_append(self, sampler):
        R = len(SCORED)
        requests, logits, tokens, _, _ = self._rollout(sampler, list(range(R)), seed=43)
        whole, _, _ = self._score(sampler, requests, list(range(R)), logits, tokens)
        batch = self.build(sampler, requests)
        for t in range(self.score_steps):
            step = sampler.score(self.on(sampler, logits[:, t]), batch, self.on(sampler, tokens[:, t]))
            for field in ("logprobs", "raw_logprobs", "kept_token", "ranks"):
                a, b = getattr(whole, field).cpu()[:, t], getattr(step, field).cpu()
                if not torch.equal(a, b):
                    row = int((a != b).nonzero()[0])
                    violation("score", f"position {t} of request {SCORED[row][0]!r}: {field} "
                                       f"{a[row].item()!r} over {self.score_steps} positions, "
                                       f"{b[row].item()!r} one step at a time with append between")
            batch.append(self.on(sampler, tokens[:, t]))

    def test_score_replays_given_kept_sets(self, sampler):
        # unseeded XTC: the coin is random, so only the rollout's kept sets reproduce it
        requests = [("xtc", SamplingParams(xtc_probability=0.5, xtc_threshold=0.03, top_k=60,
                                           temperature=0.9, logprobs=0, return_kept=True), PROMPT, None),
                    ("filters", SamplingParams(top_p=0.8, min_p=0.03, temperature=0.7, seed=5,
                                               logprobs=0, return_kept=True), PROMPT, None)]
        batch = self.build(sampler, requests, logprobs_mode="processed")
        T, V = self.score_steps, self.vocab_size
        logits = torch.randn((2, T, V), generator=torch.Generator().manual_seed(47)) * 2
        tokens, logprobs, kept = [], [], []
        for t in range(T):
            out = sampler.sample(self.on(sampler, logits[:, t]), batch)
            tokens.append(out.token_ids.cpu())
            logprobs.append(out.logprobs.logprobs[:, 0].cpu())
            kept.append(out.kept.cpu())
            batch.append(out.token_ids)
        tokens, logprobs, kept = torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(kept, 1)
        out, back, _ = self._score(sampler, requests, [0, 1], logits, tokens, kept)
        got = out.logprobs.cpu()[back]
        if not torch.allclose(got, logprobs, rtol=0, atol=1e-5):
            violation("score", f"score with the rollout's kept sets gives {got.tolist()}, the rollout "
                               f"reported {logprobs.tolist()}")
        if not bool(out.kept_token.cpu()[back].all()):
            violation("score", "score with the rollout's kept sets: a token it drew is not kept_token")

    def test_score_is_differentiable(self, sampler, reference):
        R = len(SCORED)
        requests, logits, tokens, _, kept = self._rollout(sampler, list(range(R)), seed=45)
        grads = []
        for s, kept_sets in ((sampler, None), (reference, None), (sampler, kept)):
            out, back, x = self._score(s, requests, list(range(R)), logits, tokens, kept_sets, grad=True)
            finite = torch.isfinite(out.logprobs.detach())
            loss = torch.where(finite, out.logprobs, 0.0).sum()
            loss.backward()
            grads.append(x.grad.cpu())
        if not torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5):
            violation("score", "the gradient of score's logprobs differs from the reference's")
        if not bool(grads[2].abs().sum() > 0):
            violation("score", "score with kept sets has no gradient")

    @pytest.mark.parametrize("change,fragment", [
        ("logits_rank", "logits must be"),
        ("ids_shape", "token_ids must be"),
        ("ids_dtype", "token_ids must hold integer ids"),
        ("ids_range", "out of range"),
        ("ids_gap", "after -1"),
        ("rows", "rows"),
        ("kept_shape", "kept must be int32"),
    ])
    def test_score_arguments_are_checked(self, sampler, change, fragment):
        batch = self.build(sampler, [("a", SamplingParams(seed=1), [], None),
                                     ("b", SamplingParams(seed=2), [], None)])
        T, V = 3, self.vocab_size
        logits, ids = self.logits(2 * T).view(2, T, V), torch.ones((2, T), dtype=torch.long)
        kept = None
        if change == "logits_rank":
            logits = logits[0, 0]
        elif change == "ids_shape":
            ids = ids[:, :2]
        elif change == "ids_dtype":
            ids = ids.float()
        elif change == "ids_range":
            ids[1, 2] = V
        elif change == "ids_gap":
            ids[0, 1] = -1
        elif change == "rows":
            logits, ids = logits[:1], ids[:1]
        elif change == "kept_shape":
            kept = torch.zeros((2, T, 3), dtype=torch.int32)
        before = batch.generated_counts()
        with pytest.raises(ValueError) as err:
            sampler.score(self.on(sampler, logits), batch, ids if change in ("ids_range", "ids_gap") else self.on(sampler, ids),
                          None if kept is None else self.on(sampler, kept))
        if fragment not in str(err.value):
            violation("score_args", f"{change}: score raised {err.value!s}, which does not say {fragment!r}")
        if batch.generated_counts() != before:
            violation("score_args", "a refused score changed the batch")

    def test_padding_positions_read_zero(self, sampler):
        batch = self.build(sampler, [("a", SamplingParams(seed=1, top_k=5), [], None),
                                     ("b", SamplingParams(seed=2), [], None)])
        T, V = 4, self.vocab_size
        logits = self.logits(2 * T, seed=3).view(2, T, V)
        ids = torch.tensor([[1, 2, -1, -1], [3, 4, 5, 6]])
        out = sampler.score(self.on(sampler, logits), batch, self.on(sampler, ids))
        lp, valid = out.logprobs.cpu(), out.valid.cpu()
        if valid.tolist() != [[True, True, False, False], [True] * 4] or bool(lp[0, 2:].ne(0).any()):
            violation("score", f"padding (-1) positions read valid {valid.tolist()}, logprobs "
                               f"{lp[0].tolist()}: padding is not valid and reads 0")

    def test_corelib_info_says_whose_score_gives_gradients(self, sampler):
        if self.backend is None:
            pytest.skip("a sampler made without a registered backend name has no spec to compare")
        from ..registry import default_registry
        # the statuses, not choose(): a backend's spec is the same where its device is missing
        # (the cuda backend's code runs on CPU tensors in CI)
        status = next((s for s in default_registry().statuses() if s.name == self.backend), None)
        if status is None or status.spec is None:
            violation("score", f"backend {self.backend!r} has no spec in corelib info "
                               f"({None if status is None else status.reason})")
        own = type(sampler).differentiable_score
        if status.spec.differentiable_score != own or status.score_gradients != ("own" if own else "reference"):
            violation("score", f"backend {self.backend!r}: its BackendSpec says differentiable_score="
                               f"{status.spec.differentiable_score} (corelib info: "
                               f"{status.score_gradients}), its sampler {own}")
