"""Conformance checks for the engine features: token bitmasks (structured output), the
reasoning budget and custom stages from plugins, with the helpers the verification checks
(``corelib.testing.verify``) share. ``ConformanceSuite`` inherits them, so every backend (and
every third-party plugin running the kit) proves these too.

The new samplers (DRY, top-n-sigma, typical-p, XTC) are checked through the suite's kept-set
cases (``STAGE_CASES``) and seeded requests, like every other stage.
"""

from __future__ import annotations

import zlib
from typing import Optional

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from ..bitmask import pack_bitmask
from ..hookspecs import hookimpl
from ..params import SamplingParams
from ..stages import StageError, StageSpec, StageState
from .rules import PROMPT, params_text, violation

# ---------------------------------------------------------------------- the suite's own stages
class _RepeatArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    times: int = 2


class _FloorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prob: float = 0.0


def _count_outputs(prompt, output, args, vocab_size):
    return torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab_size).to(torch.int32)


def _count_token(state, token_ids, live):
    return state.scatter_add(1, token_ids[:, None], live[:, None].to(state.dtype))


def _ban_repeats(x, inputs):
    return x.masked_fill(inputs.state["seen"] >= inputs.args["times"][:, None], float("-inf"))


def _floor(x, inputs):
    p = torch.softmax(x, dim=-1)
    low = p < torch.minimum(inputs.args["prob"][:, None], p.amax(dim=-1, keepdim=True))
    return x.masked_fill(low, float("-inf"))


def _explode(x, inputs):
    raise RuntimeError("this stage always fails")


CONFORMANCE_STAGES = [
    StageSpec("conformance-ban-repeats", "after_penalties", _RepeatArgs, _ban_repeats,
              state=(StageState("seen", torch.int32, lambda V: (V,), _count_outputs, _count_token),),
              description="conformance suite: ban a token generated `times` times"),
    StageSpec("conformance-floor", "after_filters", _FloorArgs, _floor,
              description="conformance suite: drop tokens below a probability floor"),
    StageSpec("conformance-explodes", "after_penalties", _FloorArgs, _explode,
              description="conformance suite: a stage that raises"),
]


class _ConformanceStagePlugin:
    @hookimpl
    def corelib_stages(self):
        return list(CONFORMANCE_STAGES)


# Step 8b: requests with a reasoning budget (markers 200 / 201, V >= 256), each exercising one
# rule: budget 0 inside a thinking prompt, a multi-token end marker, a transition phrase, a
# start marker generated again and again (bias) with budget 0, and a prompt not thinking.
THINK = dict(thinking_start_token_ids=[200], thinking_end_token_ids=[201])
THINKING_REQUESTS = [
    ("zero", SamplingParams(temperature=0.0, thinking_budget=0, **THINK), PROMPT + [200], None),
    ("multi", SamplingParams(seed=41, top_k=30, thinking_budget=2, thinking_start_token_ids=[200],
                             thinking_end_token_ids=[201, 202]), PROMPT + [200, 5], None),
    ("phrase", SamplingParams(temperature=0.0, presence_penalty=1.0, thinking_budget=1,
                              thinking_forced_token_ids=[210, 211, 201], **THINK), PROMPT + [200], None),
    ("again", SamplingParams(seed=42, thinking_budget=0, logit_bias={200: 100.0}, **THINK), PROMPT, None),
    ("idle", SamplingParams(seed=43, thinking_budget=1, **THINK), PROMPT, None),
]
# What the contract says they emit, where it decides (None: the model's choice).
THINKING_EXPECTED = {
    "zero": [201],
    "multi": [None, 201, 202],
    "phrase": [None, 210, 211, 201],
    "again": [200, 201, 200, 201, 200, 201],
}


class EngineConformance:
    """Bitmask, reasoning-budget and custom-stage checks, and the helpers the verification checks
    share (mixed into ``ConformanceSuite``)."""

    # ------------------------------------------------------------------ helpers
    def random_bitmask(self, rows: int, seed: int, density: float = 0.3,
                       vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 packed mask, bool allowed [rows, V]) with about ``density`` of tokens allowed."""
        V = vocab_size or self.vocab_size
        gen = torch.Generator().manual_seed(seed)
        allowed = torch.rand((rows, V), generator=gen) < density
        allowed[:, 0] |= ~allowed.any(dim=-1)          # never an empty row by accident
        return pack_bitmask(allowed), allowed

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_stages(cls):
        """The suite's custom stages registered in the process-wide registry for the class."""
        from ..registry import default_registry
        registry = default_registry()
        registry.register(_ConformanceStagePlugin(), name="corelib-conformance-stages",
                          distribution="corelib")
        yield [spec.name for spec in CONFORMANCE_STAGES]
        registry.unregister("corelib-conformance-stages")

    def step_logits(self, batch, step: int, seed: int = 5) -> torch.Tensor:
        """[rows, V] logits that depend only on (request, child, position), as a model's would
        depend on the context: equal in speculative and plain runs at the same position."""
        rows = []
        counts = batch.generated_counts()
        for (rid, child), position in zip(batch.rows, counts):
            rows.append(self.position_logits(rid, child, position + step, seed))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)

    def position_logits(self, rid: str, child: int, position: int, seed: int = 5) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{child}/{position}/{seed}".encode()))
        return torch.randn(self.vocab_size, generator=gen) * 2.0

    def plain_run(self, sampler, requests, steps: int, eos_token_id=None) -> dict:
        """{(request, child): tokens} of ``steps`` plain sample + append steps."""
        batch = self.build(sampler, requests, eos_token_id=eos_token_id)
        tokens: dict = {key: [] for key in batch.rows}
        for _ in range(steps):
            out = sampler.sample(self.on(sampler, self.step_logits(batch, 0)), batch)
            for key, token in zip(batch.rows, out.token_ids.cpu().tolist()):
                tokens[key].append(token)
            batch.append(out.token_ids)
        return tokens

    def speculative_logits(self, batch, K: int) -> torch.Tensor:
        """[rows, K + 1, V]: slot j holds the logits of position (generated + j)."""
        return torch.stack([self.step_logits(batch, j) for j in range(K + 1)], dim=1)

    # ------------------------------------------------------------------ reasoning budget
    def test_thinking_budget_forces_what_the_contract_says(self, sampler, reference):
        if self.vocab_size < 256:
            pytest.skip("the reasoning-budget cases use token ids up to 211")
        steps = 6
        got = self.plain_run(sampler, THINKING_REQUESTS, steps, eos_token_id=6)
        want = self.plain_run(reference, THINKING_REQUESTS, steps, eos_token_id=6)
        for rid, expected in THINKING_EXPECTED.items():
            tokens = got[(rid, 0)]
            for position, token in enumerate(expected):
                if token is not None and tokens[position] != token:
                    violation("thinking", f"{self.describe_request(THINKING_REQUESTS, rid)} emitted "
                                          f"{tokens}: position {position} must be the forced "
                                          f"token {token}")
        for key, tokens in want.items():
            if got[key] != tokens:
                violation("thinking", f"{self.describe_request(THINKING_REQUESTS, *key)} emitted "
                                      f"{got[key]}, the reference {tokens}")
        if got[("idle", 0)] != want[("idle", 0)]:
            violation("thinking", "a row whose prompt is not thinking was changed")

    def test_thinking_state_moves_resumes_and_verifies(self, sampler):
        if self.vocab_size < 256:
            pytest.skip("the reasoning-budget cases use token ids up to 211")
        steps = 6
        truth = self.plain_run(sampler, THINKING_REQUESTS, steps, eos_token_id=6)
        # leave and join: each request removed after 2 steps and added back with its tokens
        batch = self.build(sampler, THINKING_REQUESTS, eos_token_id=6)
        tokens = {key: [] for key in batch.rows}
        for step in range(steps):
            if step == 2:
                for rid, params, prompt, _ in THINKING_REQUESTS:
                    batch.remove(rid)
                    batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=tokens[(rid, 0)])
                batch.swap_rows(0, len(batch) - 1)
            out = sampler.sample(self.on(sampler, self.step_logits(batch, 0)), batch)
            for key, token in zip(batch.rows, out.token_ids.cpu().tolist()):
                tokens[key].append(token)
            batch.append(out.token_ids)
        for key, want in truth.items():
            if tokens[key] != want:
                violation("thinking", f"{self.describe_request(THINKING_REQUESTS, *key)} emitted "
                                      f"{tokens[key]} when removed, re-added with its tokens and "
                                      f"moved; {want} uninterrupted")
        spoken = self._speculative_run(sampler, THINKING_REQUESTS, steps, K=3, truth=truth,
                                       eos_token_id=6, corrupt=2)
        for key, want in truth.items():
            if spoken[key] != want:
                violation("thinking", f"{self.describe_request(THINKING_REQUESTS, *key)} emitted "
                                      f"{spoken[key]} through verify (K=3, every other draft wrong), "
                                      f"{want} through sample")

    def test_thinking_processed_logprob_of_a_forced_token_is_zero(self, sampler):
        if self.vocab_size < 256:
            pytest.skip("the reasoning-budget cases use token ids up to 211")
        params = SamplingParams(seed=44, logprobs=2, thinking_budget=0, min_tokens=2,
                                stop_token_ids=[201], **THINK)
        batch = self.build(sampler, [("z", params, PROMPT + [200], None)], logprobs_mode="processed")
        out = sampler.sample(self.on(sampler, self.logits(1, seed=45)), batch)
        token, logprob = int(out.token_ids[0]), float(out.logprobs.logprobs[0, 0])
        if token != 201 or not bool(out.valid[0]) or abs(logprob) > 1e-6:
            violation("thinking", f"request 'z' (params {params_text(params)}) must emit the forced "
                                  f"end marker 201 even though min_tokens masks it, with processed "
                                  f"logprob 0; got token {token} (valid {bool(out.valid[0])}), "
                                  f"logprob {logprob}")

    def test_thinking_forced_row_with_nan_logits_is_still_flagged(self, sampler):
        if self.vocab_size < 256:
            pytest.skip("the reasoning-budget cases use token ids up to 211")
        requests = [("nan", SamplingParams(temperature=0.0, thinking_budget=0, **THINK), PROMPT + [200], None),
                    ("forced", SamplingParams(seed=46, thinking_budget=0, **THINK), PROMPT + [200], None)]
        logits = self.logits(2, seed=47)
        logits[0, 9] = float("nan")
        batch = self.build(sampler, requests)
        out = sampler.sample(self.on(sampler, logits), batch)
        valid, ids = out.valid.cpu().tolist(), out.token_ids.cpu().tolist()
        if valid[0] or ids[0] != -1:
            violation("thinking", f"{self.describe(batch, 0)} has NaN logits: a forced row is still "
                                  f"flagged (valid False, token -1), got valid {valid[0]}, token {ids[0]}")
        if not valid[1] or ids[1] != 201:
            violation("thinking", f"{self.describe(batch, 1)} must emit the forced end marker 201, "
                                  f"got token {ids[1]} (valid {valid[1]})")

    # ------------------------------------------------------------------ bitmask
    def test_bitmask_kept_set_matches_reference(self, sampler, reference):
        requests = [("plain", SamplingParams(), PROMPT, None),
                    ("allowed", SamplingParams(allowed_token_ids=list(range(0, 256, 3))), PROMPT, None),
                    ("seeded", SamplingParams(seed=4, top_k=30, temperature=0.8), PROMPT, None),
                    ("greedy", SamplingParams(temperature=0.0, repetition_penalty=1.3), PROMPT, [2, 2]),
                    ("free", SamplingParams(top_p=0.9), PROMPT, None)]
        mask, allowed = self.random_bitmask(5, seed=31)
        mask[4] = -1                                    # an unconstrained row
        allowed[4] = True
        logits = self.logits(5, seed=32)
        got = sampler.processed_logits(self.on(sampler, logits), self.build(sampler, requests),
                                       token_bitmask=self.on(sampler, mask)).cpu()
        want = reference.processed_logits(logits, self.build(reference, requests), token_bitmask=mask)
        batch = self.build(reference, requests)
        for row in range(5):
            kept_got, kept_want = torch.isfinite(got[row]), torch.isfinite(want[row])
            outside = torch.nonzero(kept_got & ~allowed[row]).flatten().tolist()[:10]
            if outside:
                violation("bitmask", f"tokens {outside} kept at {self.describe(batch, row)} although "
                                     f"their bits are 0 in token_bitmask")
            if not torch.equal(kept_got, kept_want):
                extra = torch.nonzero(kept_got & ~kept_want).flatten().tolist()[:10]
                missing = torch.nonzero(kept_want & ~kept_got).flatten().tolist()[:10]
                violation("bitmask", f"kept set with a token bitmask differs from the reference at "
                                     f"{self.describe(batch, row)}: kept but should drop {extra}, "
                                     f"dropped but should keep {missing}")

    def test_bitmask_tokens_outside_the_mask_are_never_drawn(self, sampler):
        allowed_ids = [5, 7, 8, 200]
        allowed = torch.zeros((1, self.vocab_size), dtype=torch.bool)
        allowed[0, allowed_ids] = True
        mask = pack_bitmask(allowed).expand(200, -1).contiguous()
        requests = [(f"m{i}", SamplingParams(temperature=1.5, seed=i if i % 2 else None), [], None)
                    for i in range(200)]
        batch = self.build(sampler, requests)
        logits = self.logits(1, seed=3).expand(200, -1).clone()
        logits[:, 6] = 50.0            # the most likely token by far is outside the mask
        for step in range(3):
            ids = sampler.sample(self.on(sampler, logits), batch, token_bitmask=self.on(sampler, mask))
            ids = ids.token_ids.cpu().tolist()
            bad = [row for row, t in enumerate(ids) if t not in allowed_ids]
            if bad:
                violation("bitmask", f"token {ids[bad[0]]} drawn at {self.describe(batch, bad[0])} "
                                     f"(step {step}); only {allowed_ids} are allowed by the "
                                     f"token bitmask; {len(bad)} of 200 rows broke the rule")
            batch.append(torch.tensor(ids))

    def test_bitmask_on_host_or_device_and_unconstrained_rows(self, sampler):
        requests = [(f"s{i}", SamplingParams(seed=40 + i, top_p=0.9), PROMPT, None) for i in range(4)]
        logits = self.on(sampler, self.logits(4, seed=41))
        plain = sampler.sample(logits, self.build(sampler, requests)).token_ids.cpu()
        free = torch.full((4, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for where, mask in (("host", free), ("device", self.on(sampler, free))):
            got = sampler.sample(logits, self.build(sampler, requests), token_bitmask=mask).token_ids.cpu()
            if not torch.equal(got, plain):
                violation("bitmask", f"an all -1 token bitmask on the {where} changed seeded tokens: "
                                     f"{got.tolist()} with it, {plain.tolist()} without")
        mask, allowed = self.random_bitmask(4, seed=42)
        host = sampler.sample(logits, self.build(sampler, requests), token_bitmask=mask).token_ids.cpu()
        device = sampler.sample(logits, self.build(sampler, requests),
                                token_bitmask=self.on(sampler, mask)).token_ids.cpu()
        if not torch.equal(host, device):
            violation("bitmask", f"the same token bitmask gave {host.tolist()} from the host and "
                                 f"{device.tolist()} from the device")

    def test_finished_grammar_with_min_tokens_is_flagged_not_token_zero(self, sampler):
        eos = 6
        only_eos = torch.zeros((2, self.vocab_size), dtype=torch.bool)
        only_eos[0, eos] = True                         # the grammar is complete: only eos left
        only_eos[1] = True
        requests = [("done", SamplingParams(min_tokens=5, seed=3), PROMPT, [10, 11]),
                    ("other", SamplingParams(seed=4), PROMPT, None)]
        batch = self.build(sampler, requests, eos_token_id=eos)
        logits = self.logits(2, seed=43)
        out = sampler.sample(self.on(sampler, logits), batch,
                             token_bitmask=self.on(sampler, pack_bitmask(only_eos)))
        valid, ids = out.valid.cpu().tolist(), out.token_ids.cpu().tolist()
        if valid[0] or ids[0] != -1:
            violation("bitmask_flag", f"{self.describe(batch, 0)}: a finished grammar (only eos "
                                      f"allowed) with min_tokens not reached leaves no token; "
                                      f"expected a flagged row (valid False, id -1), got valid "
                                      f"{valid[0]}, token {ids[0]}")
        if not valid[1] or not 0 <= ids[1] < self.vocab_size:
            violation("bitmask_flag", f"the flagged row changed {self.describe(batch, 1)}: valid "
                                      f"{valid[1]}, token {ids[1]}")

    def test_raw_logprobs_come_before_the_bitmask(self, sampler, reference):
        requests = [("lp", SamplingParams(seed=5, logprobs=3), PROMPT, None)]
        mask, _ = self.random_bitmask(1, seed=44)
        logits = self.logits(1, seed=45)
        got = sampler.sample(self.on(sampler, logits), self.build(sampler, requests),
                             token_bitmask=self.on(sampler, mask))
        want = torch.log_softmax(logits, dim=-1).topk(3)
        top = got.logprobs.token_ids[0, 1:].cpu()
        if not torch.equal(top, want.indices[0]):
            violation("bitmask", f"raw logprobs must come from the logits before the mask: top-3 "
                                 f"ids {top.tolist()}, expected {want.indices[0].tolist()}")

    @pytest.mark.parametrize("case", ["float32", "int64", "bool", "width", "rows", "3d"])
    def test_bad_bitmasks_raise_value_error(self, sampler, case):
        requests = [("a", SamplingParams(), [], None), ("b", SamplingParams(), [], None)]
        W = (self.vocab_size + 31) // 32
        good = torch.full((2, W), -1, dtype=torch.int32)
        bad, fragment = {
            "float32": (good.float(), "int32"), "int64": (good.long(), "int32"),
            "bool": (torch.ones((2, W), dtype=torch.bool), "int32"),
            "width": (torch.full((2, W + 1), -1, dtype=torch.int32), str(W)),
            "rows": (torch.full((3, W), -1, dtype=torch.int32), "2 rows"),
            "3d": (torch.full((2, 1, W), -1, dtype=torch.int32), "token_bitmask"),
        }[case]
        batch = self.build(sampler, requests)
        with pytest.raises(ValueError) as error:
            sampler.sample(self.on(sampler, self.logits(2, seed=46)), batch, token_bitmask=self.on(sampler, bad))
        if "token_bitmask" not in str(error.value) or fragment not in str(error.value):
            violation("bitmask_args", f"a {case} token_bitmask raised {error.value!r}; the message "
                                      f"must name token_bitmask and the problem ({fragment!r})")

    # ------------------------------------------------------------------ custom stages
    def _stage_requests(self):
        return [("ban", SamplingParams(seed=61, stage_args={"conformance-ban-repeats": {"times": 1}}),
                 PROMPT, [3, 4]),
                ("floor", SamplingParams(seed=62, top_k=50, temperature=0.6, top_p=0.8,
                                         stage_args={"conformance-floor": {"prob": 0.05}}), PROMPT, None),
                ("both", SamplingParams(seed=63, n=2, stage_args={"conformance-ban-repeats": {"times": 2},
                                                                  "conformance-floor": {"prob": 0.01}}),
                 PROMPT, None),
                ("none", SamplingParams(seed=64), PROMPT, None),
                ("greedy", SamplingParams(temperature=0.0,
                                          stage_args={"conformance-ban-repeats": {"times": 1}}), PROMPT, None)]

    def test_custom_stages_match_reference(self, sampler, reference, conformance_stages):
        requests = self._stage_requests()
        logits = self.logits(6, seed=56)
        kept_got = torch.isfinite(sampler.processed_logits(self.on(sampler, logits),
                                                           self.build(sampler, requests)).cpu())
        kept_want = torch.isfinite(reference.processed_logits(logits, self.build(reference, requests)))
        batch = self.build(reference, requests)
        for row in range(len(batch.rows)):
            if not torch.equal(kept_got[row], kept_want[row]):
                extra = torch.nonzero(kept_got[row] & ~kept_want[row]).flatten().tolist()[:10]
                missing = torch.nonzero(kept_want[row] & ~kept_got[row]).flatten().tolist()[:10]
                violation("custom_stage", f"kept set differs from the reference at "
                                          f"{self.describe(batch, row)}: kept but should drop "
                                          f"{extra}, dropped but should keep {missing}")
        got = self._run_steps(sampler, self.build(sampler, requests), steps=6)
        want = self._run_steps(reference, self.build(reference, requests), steps=6)
        for key in want:
            if got.get(key) != want[key]:
                violation("custom_stage", f"{self.describe_request(requests, *key)} drew "
                                          f"{got.get(key)}, reference {want[key]} "
                                          f"({self._first_difference(got.get(key, []), want[key])})")
        banned = got[("ban", 0)]
        if len(set(banned)) != len(banned) or {3, 4} & set(banned):
            violation("custom_stage", f"request 'ban' (times=1, output [3, 4]) repeated a token: "
                                      f"{banned}")

    def test_custom_stage_state_moves_and_resumes(self, sampler, conformance_stages):
        requests = self._stage_requests()
        straight = self._run_steps(sampler, self.build(sampler, requests), steps=6)
        batch = self.build(sampler, requests)
        before = self._run_steps(sampler, batch, steps=3)
        batch.remove("floor")                              # rows after it move into its place
        batch.remove("ban")
        batch.add("ban", requests[0][1], prompt_token_ids=PROMPT,
                  output_token_ids=[3, 4] + before[("ban", 0)])    # resumed mid-generation
        after = self._run_steps(sampler, batch, steps=3, first_step=3)
        for key, tokens in after.items():
            if before[key] + tokens != straight[key]:
                violation("custom_stage", f"{self.describe_request(requests, *key)} drew "
                                          f"{before[key] + tokens} across a removal and a resumption, "
                                          f"{straight[key]} uninterrupted")

    def test_failing_custom_stage_raises_and_leaves_the_batch(self, sampler, conformance_stages):
        requests = [("ok", SamplingParams(seed=1), PROMPT, None),
                    ("boom", SamplingParams(seed=2, stage_args={"conformance-explodes": {}}), PROMPT, None)]
        batch = self.build(sampler, requests)
        with pytest.raises(StageError) as error:
            sampler.sample(self.on(sampler, self.logits(2, seed=55)), batch)
        if "conformance-explodes" not in str(error.value):
            violation("custom_stage", f"a failing stage must raise StageError naming it, got {error.value!r}")
        if batch.generated_counts() != [0, 0]:
            violation("custom_stage", "a failing stage changed the batch")
        batch.remove("boom")
        out = sampler.sample(self.on(sampler, self.logits(1, seed=55)), batch)
        if not bool(out.valid.all()):
            violation("custom_stage", "after removing the failing stage's request, sampling failed")

    def test_verify_advances_custom_stage_state(self, sampler, conformance_stages):
        requests = [("ban", SamplingParams(seed=71, top_k=4,
                                           stage_args={"conformance-ban-repeats": {"times": 1}}), PROMPT, None)]
        truth = self.plain_run(sampler, requests, steps=6)
        got = self._speculative_run(sampler, requests, 6, 3, truth, corrupt=4)
        if got != truth:
            violation("verify_slots", f"request 'ban' (a custom stage with state) emitted "
                                      f"{got[('ban', 0)]} through verify, {truth[('ban', 0)]} through sample")
