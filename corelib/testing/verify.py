"""Conformance checks of speculative decoding's verification (the contract's "Speculative
decoding: verification" and "Block verification"): ``verify`` against ``sample`` and the
reference, every stage at every slot, the target distribution kept (chi-square), the flat
form, bad arguments. Mixed into ``ConformanceSuite`` with ``EngineConformance``, whose helpers
(``step_logits``, ``plain_run``, ``speculative_logits``, ``random_bitmask``) they use.
"""

from __future__ import annotations

import pytest
import torch

from .. import pipeline
from ..params import SamplingParams
from .rules import PROMPT, chi_square_p_value, violation

# Parameters that switch every stage on (steps 3-14), for requests whose state must advance
# correctly at every draft slot: each table stage's example (so a new stage joins them), with
# the values below where they set the same field. Of the two selectors, which exclude each
# other, mirostat (``EVERY_STAGE_ADAPTIVE`` has adaptive-p instead).
EVERY_STAGE = {k: v for stage in pipeline.STAGES if stage.example is not None
               # allowed ids would leave most drafts no token to match
               and stage.name not in ("allowed_token_ids", "adaptive_p")
               for k, v in stage.example.items()}
EVERY_STAGE.update(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                   frequency_penalty=0.4, presence_penalty=0.3, logit_bias={3: 1.5, 7: -2.0},
                   min_tokens=3, stop_token_ids=[4], bad_words=[[1, 5], [9, 9, 6]],
                   dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=[8],
                   top_n_sigma=3.0, typical_p=0.97, xtc_probability=0.5, xtc_threshold=0.2)
EVERY_STAGE_ADAPTIVE = {**{k: v for k, v in EVERY_STAGE.items() if not k.startswith("mirostat")},
                        **next(s.example for s in pipeline.STAGES if s.name == "adaptive_p")}


def _drafts_from(sequences: list[list[int]], K: int) -> torch.Tensor:
    """int64 [rows, K]: each row's first K proposals, -1 padding."""
    out = torch.full((len(sequences), K), -1, dtype=torch.long)
    for row, seq in enumerate(sequences):
        seq = seq[:K]
        if seq:
            out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


class VerifyConformance:
    """Verification checks (mixed into ``ConformanceSuite``)."""

    #: rows of the rejection-sampling chi-square test (one verify call, small vocabulary)
    verify_rows: int = 4000

    def test_verify_with_no_drafts_equals_sample(self, sampler):
        requests = [("s", SamplingParams(seed=7, **EVERY_STAGE), PROMPT, None),
                    ("g", SamplingParams(temperature=0.0, repetition_penalty=1.3), PROMPT, [2]),
                    ("n", SamplingParams(seed=8, n=2, top_k=5), PROMPT, None)]
        logits = self.logits(4, seed=47)
        batch = self.build(sampler, requests, eos_token_id=6)
        want = sampler.sample(self.on(sampler, logits), batch).token_ids.cpu()
        out = sampler.verify(self.on(sampler, logits[:, None]), self.build(sampler, requests, eos_token_id=6),
                             self.on(sampler, torch.empty((4, 0), dtype=torch.long)))
        got = out.token_ids.cpu()
        if tuple(got.shape) != (4, 1) or not torch.equal(got[:, 0], want) or out.num_emitted.cpu().tolist() != [1] * 4:
            violation("verify_k0", f"verify with K = 0 gave {got.tolist()} (num_emitted "
                                   f"{out.num_emitted.cpu().tolist()}), sample gave {want.tolist()}")

    def _speculative_run(self, sampler, requests, steps: int, K: int, truth: dict,
                         eos_token_id=None, corrupt: int = 3) -> dict:
        """Tokens of verify + append steps until every row has ``steps`` tokens. Drafts come
        from ``truth`` (the plain run), every ``corrupt``-th proposal wrong and some rows
        proposing fewer than K."""
        batch = self.build(sampler, requests, eos_token_id=eos_token_id)
        tokens: dict = {key: [] for key in batch.rows}
        for call in range(steps):
            if all(len(v) >= steps for v in tokens.values()):
                break
            proposals = []
            for row, key in enumerate(batch.rows):
                done = len(tokens[key])
                seq = list(truth[key][done:done + K])
                for j in range(len(seq)):
                    if (row + call + j) % corrupt == corrupt - 1:
                        seq[j] = (seq[j] + 1) % self.vocab_size
                proposals.append(seq[: K - (row % 2)])
            drafts = _drafts_from(proposals, K)
            out = sampler.verify(self.on(sampler, self.speculative_logits(batch, K)), batch,
                                 self.on(sampler, drafts))
            emitted = out.token_ids.cpu()
            for row, key in enumerate(batch.rows):
                count = int(out.num_emitted[row])
                tokens[key].extend(emitted[row, :count].tolist())
            batch.append(out.token_ids)
        return {key: v[:steps] for key, v in tokens.items()}

    @pytest.mark.parametrize("K", [1, 3])
    def test_verify_keeps_seeded_and_greedy_tokens_of_plain_sampling(self, sampler, K):
        requests = [("every", SamplingParams(seed=21, **EVERY_STAGE), PROMPT, None),
                    ("kids", SamplingParams(seed=22, n=2, temperature=1.1, top_p=0.9,
                                            presence_penalty=0.5), PROMPT, None),
                    ("greedy", SamplingParams(temperature=0.0, repetition_penalty=1.4,
                                              dry_multiplier=1.0, bad_words=[[3, 3]]), PROMPT, None),
                    ("plain", SamplingParams(seed=23), [], None)]
        steps = 8
        truth = self.plain_run(sampler, requests, steps, eos_token_id=6)
        got = self._speculative_run(sampler, requests, steps, K, truth, eos_token_id=6)
        for key, want in truth.items():
            if got[key] != want:
                step = next(i for i, (a, b) in enumerate(zip(got[key], want)) if a != b)
                violation("verify_seeded", f"{self.describe_request(requests, *key)} emitted "
                                           f"{got[key]} through verify (K={K}), {want} through "
                                           f"sample (first difference at position {step})")

    @pytest.mark.parametrize("selector", ["mirostat", "adaptive_p"])
    def test_verify_applies_every_stage_at_every_slot(self, sampler, selector):
        every = EVERY_STAGE if selector == "mirostat" else EVERY_STAGE_ADAPTIVE
        requests = [("every", SamplingParams(seed=31, logprobs=4, **every), PROMPT, [9, 1]),
                    ("greedy", SamplingParams(temperature=0.0, logprobs=4, frequency_penalty=1.0,
                                              min_tokens=2, dry_multiplier=2.0), PROMPT, [2])]
        K = 3
        drafts = torch.tensor([[5, 1, 5], [2, 2, 9]])
        verify_batch = self.build(sampler, requests, eos_token_id=6, logprobs_mode="processed")
        logits = self.speculative_logits(verify_batch, K)
        got = sampler.verify(self.on(sampler, logits), verify_batch, self.on(sampler, drafts))
        for j in range(K + 1):
            batch = self.build(sampler, requests, eos_token_id=6, logprobs_mode="processed")
            for i in range(j):
                # the step at slot i first: the selectors' state advances from its distribution
                sampler.sample(self.on(sampler, logits[:, i]), batch)
                batch.append(drafts[:, i])
            want = sampler.sample(self.on(sampler, logits[:, j]), batch)
            for row in range(2):
                g_ids = got.logprobs.token_ids[row, j, 1:].cpu()
                w_ids = want.logprobs.token_ids[row, 1:].cpu()
                g_lp = got.logprobs.logprobs[row, j, 1:].cpu()
                w_lp = want.logprobs.logprobs[row, 1:].cpu()
                if not torch.equal(g_ids, w_ids) or not torch.allclose(g_lp, w_lp, atol=1e-4, rtol=1e-4):
                    violation("verify_slots",
                              f"slot {j} of {self.describe(batch, row)}: the target distribution "
                              f"(processed top-4 {g_ids.tolist()} {g_lp.tolist()}) differs from "
                              f"sample after appending drafts {drafts[row, :j].tolist()} "
                              f"({w_ids.tolist()} {w_lp.tolist()})")

    def test_verify_matches_reference(self, sampler, reference):
        requests = [("every", SamplingParams(seed=41, logprobs=2, **EVERY_STAGE), PROMPT, [9]),
                    ("greedy", SamplingParams(temperature=0.0, logprobs=2, top_k=3), PROMPT, None),
                    ("topk", SamplingParams(seed=42, n=2, top_k=8, logprobs=2), PROMPT, None),
                    ("short", SamplingParams(seed=43, logprobs=2), [], None)]
        K = 3
        gen = torch.Generator().manual_seed(48)
        probe = self.build(reference, requests, eos_token_id=6)
        logits = self.speculative_logits(probe, K) * 1.5
        greedy = torch.argmax(logits, dim=-1)
        drafts = torch.randint(0, self.vocab_size, (5, K), generator=gen)
        drafts[1] = greedy[1, :K]                       # the greedy row's drafts are right
        drafts[4, 1:] = -1                              # one proposal only
        q = torch.softmax(torch.randn((5, K, self.vocab_size), generator=gen), dim=-1)
        mask, _ = self.random_bitmask(5 * (K + 1), seed=49, density=0.6)
        mask = mask.view(5, K + 1, -1)
        for probs in (None, q):
            kind = "with draft_probs" if probs is not None else "without draft_probs"
            got = sampler.verify(self.on(sampler, logits), self.build(sampler, requests, eos_token_id=6),
                                 self.on(sampler, drafts), None if probs is None else self.on(sampler, probs),
                                 token_bitmask=self.on(sampler, mask))
            want = reference.verify(logits, self.build(reference, requests, eos_token_id=6), drafts,
                                    probs, token_bitmask=mask)
            batch = self.build(reference, requests)
            for row in range(5):
                g, w = got.token_ids[row].cpu(), want.token_ids[row]
                if not torch.equal(g, w) or int(got.num_emitted[row]) != int(want.num_emitted[row]):
                    violation("verify_reference", f"{kind}, {self.describe(batch, row)} with drafts "
                                                  f"{drafts[row].tolist()}: emitted {g.tolist()}, "
                                                  f"reference {w.tolist()}")
                n = int(want.num_emitted[row])
                g_lp = got.logprobs.logprobs[row, :n].cpu()
                w_lp = want.logprobs.logprobs[row, :n]
                if tuple(got.logprobs.token_ids.shape) != (5, K + 1, 3) or not torch.allclose(
                        g_lp, w_lp, atol=1e-4, rtol=1e-4):
                    violation("verify_reference", f"{kind}, logprobs of {self.describe(batch, row)} "
                                                  f"differ: {g_lp.tolist()}, reference {w_lp.tolist()} "
                                                  f"(shape {tuple(got.logprobs.token_ids.shape)}, "
                                                  f"expected {(5, K + 1, 3)})")

    @pytest.mark.parametrize("greedy", [False, True], ids=["mixed", "greedy"])
    def test_flat_verify_equals_padded_verify(self, sampler, greedy):
        """verify's flat form (``num_drafts``: each row's slots one after the other, as engines
        hold them) emits what the padded form emits for the same slots: tokens, counts, flags
        and logprobs. Rows with 0 to 3 drafts; a -1 among a row's drafts ends them; in the
        greedy batch one row meets NaN logits at its second slot and stops there."""
        if greedy:
            requests = [(f"g{i}", SamplingParams(temperature=0.0, logprobs=2 if i == 4 else None),
                         PROMPT, None) for i in range(5)]
        else:
            requests = [("every", SamplingParams(seed=41, logprobs=2, **EVERY_STAGE), PROMPT, [9]),
                        ("greedy", SamplingParams(temperature=0.0, logprobs=2, top_k=3), PROMPT, None),
                        ("topk", SamplingParams(seed=42, n=2, top_k=8, logprobs=2), PROMPT, None),
                        ("short", SamplingParams(seed=43, logprobs=2), [], None)]
        num_drafts, K, V = [3, 0, 2, 1, 3], 3, self.vocab_size
        starts = [sum(num_drafts[:r]) + r for r in range(5)]          # each row's first slot
        flat = self.logits(sum(num_drafts) + 5, seed=77) * 1.5
        if greedy:
            flat[starts[2] + 1, 4] = float("nan")
        gen = torch.Generator().manual_seed(78)
        drafts = [torch.argmax(flat[starts[r]:starts[r] + k], dim=-1) for r, k in enumerate(num_drafts)]
        drafts[0][1] = (drafts[0][1] + 1) % V                         # a wrong draft
        drafts[4][1] = -1                                             # ends row 4's drafts
        flat_ids = torch.cat(drafts)
        flat_q = torch.softmax(torch.randn((sum(num_drafts), V), generator=gen), dim=-1)
        flat_mask, _ = self.random_bitmask(sum(num_drafts) + 5, seed=79, density=0.7)
        # the padded form of the same slots, built row by row
        logits = torch.zeros((5, K + 1, V))
        ids = torch.full((5, K), -1, dtype=torch.long)
        q = torch.full((5, K, V), 1.0 / V)
        mask = torch.full((5, K + 1, flat_mask.shape[1]), -1, dtype=torch.int32)
        for r, k in enumerate(num_drafts):
            first, first_draft = starts[r], starts[r] - r
            logits[r, :k + 1] = flat[first:first + k + 1]
            mask[r, :k + 1] = flat_mask[first:first + k + 1]
            q[r, :k] = flat_q[first_draft:first_draft + k]
            row_ids = flat_ids[first_draft:first_draft + k].tolist()
            row_ids = row_ids[:row_ids.index(-1)] if -1 in row_ids else row_ids
            ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        for with_probs in (False, True):
            kind = "with draft_probs" if with_probs else "without draft_probs"
            got = sampler.verify(self.on(sampler, flat), self.build(sampler, requests, eos_token_id=6),
                                 self.on(sampler, flat_ids),
                                 self.on(sampler, flat_q) if with_probs else None,
                                 token_bitmask=self.on(sampler, flat_mask), num_drafts=num_drafts)
            want = sampler.verify(self.on(sampler, logits), self.build(sampler, requests, eos_token_id=6),
                                  self.on(sampler, ids), self.on(sampler, q) if with_probs else None,
                                  token_bitmask=self.on(sampler, mask))
            batch = self.build(sampler, requests)
            for row in range(5):
                g, w = got.token_ids[row].cpu(), want.token_ids[row].cpu()
                n = int(want.num_emitted[row])
                if (not torch.equal(g, w) or int(got.num_emitted[row]) != n
                        or bool(got.valid[row]) != bool(want.valid[row])):
                    violation("verify_flat", f"{kind}, {self.describe(batch, row)} with "
                                             f"{num_drafts[row]} drafts: the flat form emitted "
                                             f"{g.tolist()}, the padded form {w.tolist()}")
                if want.logprobs is not None:
                    g_lp = got.logprobs.logprobs[row, :n].cpu()
                    w_lp = want.logprobs.logprobs[row, :n].cpu()
                    if not torch.allclose(g_lp, w_lp, atol=1e-4, rtol=1e-4, equal_nan=True):
                        violation("verify_flat", f"{kind}, logprobs of {self.describe(batch, row)} "
                                                 f"differ: {g_lp.tolist()}, padded {w_lp.tolist()}")
            if greedy and (int(got.num_emitted[2]) != 1 or int(got.num_emitted[1]) != 1):
                violation("verify_flat", f"greedy rows: a row whose second slot is NaN emits its "
                                         f"first accepted draft and stops, a row without drafts its "
                                         f"argmax; got num_emitted {got.num_emitted.tolist()}")

    @pytest.mark.parametrize("case", ["logits_rows", "ids_length", "negative_count", "count_rows",
                                      "not_counts", "probs_shape", "bitmask_rows", "id_out_of_range"])
    def test_bad_flat_verify_arguments_raise_value_error(self, sampler, case):
        requests = [("a", SamplingParams(seed=1), [], None), ("b", SamplingParams(seed=2), [], None)]
        V, num_drafts = self.vocab_size, [2, 1]
        logits = self.logits(5, seed=80)
        drafts = torch.tensor([1, 2, 3])
        probs = torch.full((3, V), 1.0 / V)
        mask = torch.full((5, (V + 31) // 32), -1, dtype=torch.int32)
        args = {
            "logits_rows": (dict(logits=logits[:4]), "logits"),
            "ids_length": (dict(draft_token_ids=drafts[:2]), "draft_token_ids"),
            "negative_count": (dict(num_drafts=[3, -1]), "num_drafts"),
            "count_rows": (dict(num_drafts=[2, 1, 0]), "num_drafts"),
            "not_counts": (dict(num_drafts=[2.0, 1.0]), "num_drafts"),
            "probs_shape": (dict(draft_probs=probs[:2]), "draft_probs"),
            "bitmask_rows": (dict(token_bitmask=mask[:3]), "token_bitmask"),
            "id_out_of_range": (dict(draft_token_ids=torch.tensor([1, V, 3])), "draft_token_ids"),
        }
        changed, name = args[case]
        if case == "id_out_of_range" and sampler.device.type != "cpu":
            pytest.skip("draft ids on an accelerator are checked per row (flagged), not raised")
        call = dict(logits=logits, draft_token_ids=drafts, draft_probs=None, token_bitmask=None,
                    num_drafts=num_drafts)
        call.update(changed)
        for key in ("logits", "draft_token_ids", "draft_probs", "token_bitmask"):
            if call[key] is not None:
                call[key] = self.on(sampler, call[key])
        batch = self.build(sampler, requests)
        with pytest.raises(ValueError) as error:
            sampler.verify(call.pop("logits"), batch, call.pop("draft_token_ids"), **call)
        if name not in str(error.value):
            violation("verify_args", f"flat verify with bad {case} raised {error.value!r}, which "
                                     f"does not name {name}")
        if batch.generated_counts() != [0, 0]:
            violation("verify_args", "a rejected verify call changed the batch")

    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    def test_verify_rejection_sampling_keeps_the_target_distribution(self, sampler, seeded):
        V, K, R = 16, 2, self.verify_rows
        gen = torch.Generator().manual_seed(50 + seeded)
        target = torch.randn((K + 1, V), generator=gen) * 1.2
        q = torch.softmax(torch.randn((K, V), generator=gen) * 1.2, dim=-1)   # deliberately off
        p = torch.softmax(target, dim=-1)
        drafts = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen)
                              for j in range(K)], dim=1)
        batch = sampler.new_batch(V)
        for i in range(R):
            batch.add(f"v{i}", SamplingParams(seed=1000 + i if seeded else None))
        torch.manual_seed(51)
        out = sampler.verify(self.on(sampler, target.expand(R, -1, -1).contiguous()), batch,
                             self.on(sampler, drafts), self.on(sampler, q.expand(R, -1, -1).contiguous()))
        ids, count = out.token_ids.cpu(), out.num_emitted.cpu()
        what = f"{R} rows, V={V}, K={K}, {'seeded' if seeded else 'unseeded'}"
        first = torch.bincount(ids[:, 0], minlength=V)
        p_value = chi_square_p_value(first, p[0])
        if not p_value > self.min_p_value:
            violation("verify_distribution", f"the first emitted token does not follow the target "
                                             f"p at slot 0 (chi-square p={p_value:.2e}; {what})")
        second = torch.bincount(ids[count >= 2, 1], minlength=V)
        p_value = chi_square_p_value(second, p[1])
        if not p_value > self.min_p_value:
            violation("verify_distribution", f"the second emitted token does not follow the target "
                                             f"p at slot 1 (chi-square p={p_value:.2e}; {what})")
        accepted = (count >= 2).double().mean()
        expected = torch.minimum(p[0], q[0]).sum().double()
        sigma = (expected * (1 - expected) / R).sqrt()
        if (accepted - expected).abs() > 5 * sigma:
            violation("verify_acceptance", f"draft 0 was accepted in {float(accepted):.4f} of rows, "
                                           f"expected sum(min(p, q)) = {float(expected):.4f} "
                                           f"(tolerance 5 sigma = {float(5 * sigma):.4f}; {what})")

    def block_run(self, sampler, p: torch.Tensor, q: torch.Tensor, method: str, seeded: bool,
                  seed: int):
        """One ``verify`` of ``verify_rows`` rows with the same context-free target ``p``
        ``[K + 1, V]`` (probabilities) at every row and drafts drawn from ``q`` ``[K, V]``.
        Returns (emitted ids ``[R, K + 1]``, num_emitted ``[R]``) on the host."""
        R, (K, V) = self.verify_rows, q.shape
        gen = torch.Generator().manual_seed(seed)
        drafts = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen)
                              for j in range(K)], dim=1)
        batch = sampler.new_batch(V)
        for i in range(R):
            batch.add(f"b{i}", SamplingParams(seed=7000 + i if seeded else None))
        torch.manual_seed(seed + 1)
        out = sampler.verify(self.on(sampler, p.log().expand(R, -1, -1).contiguous()), batch,
                             self.on(sampler, drafts), self.on(sampler, q.expand(R, -1, -1).contiguous()),
                             method=method)
        return out.token_ids.cpu(), out.num_emitted.cpu()

    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    def test_block_verification_keeps_the_target_distribution(self, sampler, seeded):
        V, K = 8, 2
        gen = torch.Generator().manual_seed(70 + seeded)
        p = torch.softmax(torch.randn((K + 1, V), generator=gen) * 1.2, dim=-1)
        q = torch.softmax(torch.randn((K, V), generator=gen) * 1.2, dim=-1)   # deliberately off
        ids, count = self.block_run(sampler, p, q, "block", seeded, seed=72)
        # A row that emitted one token continues from the target at slot 1 (context-free here),
        # so every row yields a two-token sequence whose law must be p_0 x p_1.
        second = torch.multinomial(p[1], ids.shape[0], replacement=True,
                                   generator=torch.Generator().manual_seed(73))
        second = torch.where(count >= 2, ids[:, 1], second)
        pairs = torch.bincount(ids[:, 0] * V + second, minlength=V * V)
        p_value = chi_square_p_value(pairs, (p[0][:, None] * p[1][None, :]).flatten())
        if not p_value > self.min_p_value:
            violation("verify_block", f"two-token sequences emitted by block verification do not "
                                      f"follow the target p_0 x p_1 (chi-square p={p_value:.2e}; "
                                      f"{ids.shape[0]} rows, V={V}, K={K}, "
                                      f"{'seeded' if seeded else 'unseeded'})")

    def test_block_verification_accepts_at_least_the_token_rule(self, sampler):
        V, K = 8, 2
        gen = torch.Generator().manual_seed(74)
        p = torch.softmax(torch.randn((K + 1, V), generator=gen) * 1.5, dim=-1)
        q = torch.softmax(torch.randn((K, V), generator=gen) * 1.5, dim=-1)
        # A case where the block rule must win: the token rule accepts 0.6 * (1 + 0.6) = 0.96
        # drafts on average here, block verification 1.16 (by the paper's formulas).
        built_p = torch.tensor([[0.5, 0.5], [0.1, 0.9], [0.3, 0.7]])
        built_q = torch.tensor([[0.1, 0.9], [0.5, 0.5]])
        token_rule = float(torch.minimum(built_p[0], built_q[0]).sum()
                           * (1 + torch.minimum(built_p[1], built_q[1]).sum()))
        for case, (pp, qq) in {"random": (p, q), "built": (built_p, built_q)}.items():
            means = {}
            calls = max(1, -(-4000 // self.verify_rows))           # at least 4000 rows each
            for method in ("token", "block"):
                counts = [self.block_run(sampler, pp, qq, method, seeded=True, seed=75 + 2 * call)[1]
                          for call in range(calls)]
                means[method] = (torch.cat(counts) - 1).double()
            sigma = float((means["block"].var() / len(means["block"])
                           + means["token"].var() / len(means["token"])).sqrt())
            block_sigma = float((means["block"].var() / len(means["block"])).sqrt())
            block, token = float(means["block"].mean()), float(means["token"].mean())
            what = f"case {case}: {len(means['block'])} rows, K={K}; block {block:.4f}, token {token:.4f}"
            if block < token - 4 * sigma:
                violation("verify_block", f"block verification accepted fewer drafts on average than "
                                          f"the token rule on the same inputs ({what}; tolerance "
                                          f"4 sigma = {4 * sigma:.4f})")
            if case == "built" and not block > token_rule + 5 * block_sigma:
                violation("verify_block", f"block verification must accept more drafts than the "
                                          f"token rule's {token_rule:.2f} here ({what}; margin "
                                          f"5 sigma = {5 * block_sigma:.4f})")

    def test_block_method_keeps_the_token_rule_without_draft_probabilities(self, sampler):
        requests = [("s", SamplingParams(seed=11, top_k=30), PROMPT, None),
                    ("g", SamplingParams(temperature=0.0), PROMPT, None),
                    ("u", SamplingParams(temperature=0.0, presence_penalty=1.0), PROMPT, None)]
        K = 3
        logits = self.logits(3 * (K + 1), seed=76).view(3, K + 1, -1)
        drafts = torch.argmax(logits, dim=-1)[:, :K]
        outs = {method: sampler.verify(self.on(sampler, logits), self.build(sampler, requests),
                                       self.on(sampler, drafts), method=method)
                for method in ("token", "block")}
        if not torch.equal(outs["token"].token_ids.cpu(), outs["block"].token_ids.cpu()):
            violation("verify_block", f"without draft probabilities method='block' must keep the token "
                                      f"rule: emitted {outs['block'].token_ids.tolist()}, token rule "
                                      f"{outs['token'].token_ids.tolist()}")

    def test_verify_stops_at_a_slot_without_tokens(self, sampler):
        requests = [("nan", SamplingParams(seed=1), PROMPT, None),
                    ("masked", SamplingParams(temperature=0.0), PROMPT, None),
                    ("ok", SamplingParams(temperature=0.0), PROMPT, None)]
        K = 3
        logits = self.logits(3 * (K + 1), seed=52).view(3, K + 1, -1)
        logits[0, 0, 5] = float("nan")                 # slot 0 has no token: flagged
        drafts = torch.argmax(logits, dim=-1)[:, :K]    # greedy drafts: all right
        mask = torch.full((3, K + 1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        mask[1, 2] = 0                                  # row 1's slot 2 allows nothing
        out = sampler.verify(self.on(sampler, logits), self.build(sampler, requests),
                             self.on(sampler, drafts), token_bitmask=self.on(sampler, mask))
        ids, count, valid = out.token_ids.cpu(), out.num_emitted.cpu().tolist(), out.valid.cpu().tolist()
        batch = self.build(sampler, requests)
        if valid[0] or count[0] != 0 or ids[0].tolist() != [-1] * (K + 1):
            violation("verify_flags", f"{self.describe(batch, 0)} has NaN logits at slot 0: expected "
                                      f"a flagged row (valid False, num_emitted 0, ids -1), got "
                                      f"{valid[0]}, {count[0]}, {ids[0].tolist()}")
        if not valid[1] or count[1] != 2 or ids[1].tolist() != drafts[1, :2].tolist() + [-1, -1]:
            violation("verify_flags", f"{self.describe(batch, 1)}: slot 2 allows no token, so the "
                                      f"row emits its two accepted drafts {drafts[1, :2].tolist()} and "
                                      f"stops; got {ids[1].tolist()} (num_emitted {count[1]})")
        want = torch.argmax(logits[2], dim=-1).tolist()
        if count[2] != K + 1 or ids[2].tolist() != want:
            violation("verify_flags", f"{self.describe(batch, 2)} with correct greedy drafts must emit "
                                      f"{want}, got {ids[2].tolist()} (a bad row changed another?)")

    @pytest.mark.parametrize("case", ["logits_2d", "k_mismatch", "float_ids", "probs_shape",
                                      "id_out_of_range", "padding_gap", "probs_int", "method"])
    def test_bad_verify_arguments_raise_value_error(self, sampler, case):
        requests = [("a", SamplingParams(seed=1), [], None), ("b", SamplingParams(seed=2), [], None)]
        V, K = self.vocab_size, 2
        logits = self.logits(2 * (K + 1), seed=53).view(2, K + 1, V)
        drafts = torch.tensor([[1, 2], [3, -1]])
        probs = torch.full((2, K, V), 1.0 / V)
        args = {
            "logits_2d": (logits[:, 0], drafts, None, "logits"),
            "k_mismatch": (logits, drafts[:, :1], None, "draft_token_ids"),
            "float_ids": (logits, drafts.float(), None, "draft_token_ids"),
            "probs_shape": (logits, drafts, probs[:, :1], "draft_probs"),
            "id_out_of_range": (logits, torch.tensor([[1, V], [3, -1]]), None, "draft_token_ids"),
            "padding_gap": (logits, torch.tensor([[-1, 2], [3, -1]]), None, "draft_token_ids"),
            "probs_int": (logits, drafts, probs.long(), "draft_probs"),
            "method": (logits, drafts, probs, "method"),
        }
        bad_logits, bad_drafts, bad_probs, name = args[case]
        method = "blocks" if case == "method" else "token"
        if case in ("id_out_of_range", "padding_gap") and sampler.device.type != "cpu":
            pytest.skip("draft ids on an accelerator are checked per row (flagged), not raised")
        batch = self.build(sampler, requests)
        with pytest.raises(ValueError) as error:
            sampler.verify(self.on(sampler, bad_logits), batch, self.on(sampler, bad_drafts),
                           None if bad_probs is None else self.on(sampler, bad_probs), method=method)
        if name not in str(error.value):
            violation("verify_args", f"verify with bad {case} raised {error.value!r}, which does "
                                     f"not name {name}")
        if batch.generated_counts() != [0, 0]:
            violation("verify_args", "a rejected verify call changed the batch")

    def test_bad_draft_probabilities_flag_only_their_row(self, sampler):
        requests = [("neg", SamplingParams(seed=1), [], None), ("nan", SamplingParams(seed=2), [], None),
                    ("ok", SamplingParams(seed=3), [], None)]
        V, K = self.vocab_size, 2
        logits = self.logits(3 * (K + 1), seed=54).view(3, K + 1, V)
        drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])
        probs = torch.full((3, K, V), 1.0 / V)
        probs[0, 1, 7] = -0.5
        probs[1, 0, 9] = float("nan")
        got = sampler.verify(self.on(sampler, logits), self.build(sampler, requests),
                             self.on(sampler, drafts), self.on(sampler, probs))
        clean = probs.clone()
        clean[:2] = 1.0 / V
        want = sampler.verify(self.on(sampler, logits), self.build(sampler, requests),
                              self.on(sampler, drafts), self.on(sampler, clean))
        valid = got.valid.cpu().tolist()
        if valid[:2] != [False, False] or got.num_emitted.cpu().tolist()[:2] != [0, 0]:
            violation("verify_flags", f"rows with negative or NaN draft probabilities must be "
                                      f"flagged (valid False, num_emitted 0); got valid {valid}")
        if not torch.equal(got.token_ids[2].cpu(), want.token_ids[2].cpu()):
            violation("verify_flags", f"bad draft probabilities of other rows changed row 2: "
                                      f"{got.token_ids[2].tolist()} vs {want.token_ids[2].tolist()}")
