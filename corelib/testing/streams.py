"""The conformance suite's checks of seeded streams and row state (the contract's "Seeds" and
"Continuous batching"): seeded tokens equal the reference's whatever the batch holds, children
draw distinct streams, and rows that join, leave or resume keep every other row's draws. Mixed
into ``ConformanceSuite``, so every backend (third-party ones included) proves them.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from ..params import SamplingParams
from .rules import PROMPT, params_text, violation


class SeedStreamConformance:
    """Seeds and row bookkeeping; the helpers ``_run_steps`` and ``_seeded_requests`` serve
    the other parts of the suite too."""
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
            ("s-more", SamplingParams(seed=16, dry_multiplier=1.2, dry_allowed_length=1,
                                      top_n_sigma=2.5, typical_p=0.9, xtc_probability=0.5,
                                      xtc_threshold=0.05), PROMPT, None),
            # the fourth release: the new filters, the two selectors, an order of its own
            ("s-fourth", SamplingParams(seed=17, temperature=0.9, dynatemp_range=0.4,
                                        smoothing_factor=0.2, top_a=0.05, epsilon_cutoff=0.001,
                                        eta_cutoff=0.001, tfs=0.97, p_less="norm"), PROMPT, None),
            ("s-mirostat", SamplingParams(seed=18, mirostat_tau=4.0, mirostat_eta=0.2, top_k=60,
                                          n=2), PROMPT, None),
            ("s-adaptive", SamplingParams(seed=19, adaptive_p_target=0.3, min_p=0.01), PROMPT, None),
            ("s-order", SamplingParams(seed=20, temperature=0.6, top_k=30, min_p=0.05,
                                       sampler_order=["top_k", "min_p", "temperature"]), PROMPT, None),
        ]

    def _run_steps(self, sampler, batch, steps: int, seed: int = 5, only: Optional[str] = None,
                   first_step: int = 0):
        """Sample ``steps`` steps; logits depend on (request, child, step) only. Returns
        {(request_id, child): [tokens]}."""
        tokens: dict = {}
        for step in range(first_step, first_step + steps):
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

    @staticmethod
    def _first_difference(got: list, want: list) -> str:
        step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return f"first at position {step}"

    def test_seeded_tokens_equal_the_reference(self, sampler, reference):
        requests = self._seeded_requests()
        got = self._run_steps(sampler, self.build(sampler, requests, eos_token_id=6), steps=6)
        want = self._run_steps(reference, self.build(reference, requests, eos_token_id=6), steps=6)
        for key in want:
            if got.get(key) != want[key]:
                violation("seed_reference",
                          f"seeded tokens differ from the reference for "
                          f"{self.describe_request(requests, *key)}, prompt {PROMPT}: got "
                          f"{got.get(key)}, reference {want[key]} "
                          f"({self._first_difference(got.get(key, []), want[key])})")

    def test_seeded_tokens_independent_of_batch_composition(self, sampler):
        requests = self._seeded_requests()
        alone = {}
        for req in requests:
            alone.update(self._run_steps(sampler, self.build(sampler, [req]), steps=4))
        others = [(f"noise{i}", SamplingParams(temperature=1.5, top_k=7), [i], None) for i in range(5)]
        mixed_requests = others[:2] + list(reversed(requests)) + others[2:]
        batch = self.build(sampler, mixed_requests)
        rows = batch.rows
        mixed = self._run_steps(sampler, batch, steps=4)
        for key, tokens in alone.items():
            if mixed[key] != tokens:
                violation("seed_batch",
                          f"{self.describe_request(requests, *key)} drew {mixed[key]} at row "
                          f"{rows.index(key)} of a mixed batch of {len(rows)} rows but {tokens} "
                          f"alone ({self._first_difference(mixed[key], tokens)})")

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
        if len({tuple(s) for s in streams.values()}) != 4:
            same = [(a, b) for a in streams for b in streams if a < b and streams[a] == streams[b]]
            violation("children", f"children of one request share a stream: children {same} drew "
                                  f"the same tokens on uniform logits; streams {streams}; request "
                                  f"'kids' params {params_text(params)}")

    def test_child_zero_equals_single_completion(self, sampler):
        params = dict(seed=2024, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
        many = self._run_steps(sampler, self.build(sampler, [("r", SamplingParams(n=3, **params), PROMPT, None)]), steps=5)
        one = self._run_steps(sampler, self.build(sampler, [("r", SamplingParams(n=1, **params), PROMPT, None)]), steps=5)
        if many[("r", 0)] != one[("r", 0)]:
            violation("child_zero", f"child 0 of n=3 drew {many[('r', 0)]}, the same request with "
                                    f"n=1 drew {one[('r', 0)]} (params {params_text(params)}, "
                                    f"prompt {PROMPT}; {self._first_difference(many[('r', 0)], one[('r', 0)])})")

    def test_a_split_child_draws_as_the_parents_child(self, sampler):
        params = dict(seed=4242, temperature=1.0, top_k=40, presence_penalty=0.5)
        steps = [self.logits(3, seed=60 + step, scale=1.0) for step in range(5)]

        def run(batch):
            tokens = []
            for logits in steps:
                out = sampler.sample(self.on(sampler, logits), batch)
                batch.append(out.token_ids)
                tokens.append(out.token_ids.cpu().tolist())
            return [list(column) for column in zip(*tokens)]   # per row

        parent = run(self.build(sampler, [("p", SamplingParams(n=3, **params), PROMPT, None)]))
        split = self.build(sampler, [])
        for child in range(3):
            split.add(f"p-{child}", SamplingParams(**params), prompt_token_ids=PROMPT, child_offset=child)
        children = run(split)
        for child in range(3):
            if children[child] != parent[child]:
                violation("children", f"request 'p-{child}' (n=1, child_offset={child}, params "
                                      f"{params_text(params)}) drew {children[child]}; child "
                                      f"{child} of the same request with n=3 drew {parent[child]}")
        if children[1] == parent[0]:
            violation("children", "child_offset=1 drew child 0's stream")

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
        resumed, straight = run(True), run(False)
        for child in range(2):
            if resumed[child] != straight[child]:
                violation("resume", f"request 'r' child {child} (params {params_text(params)}, "
                                    f"eos 6) removed and re-added after 3 tokens drew "
                                    f"{resumed[child]}, uninterrupted {straight[child]}")

    def test_remove_keeps_other_rows_state(self, sampler):
        requests = self._seeded_requests()
        straight = self._run_steps(sampler, self.build(sampler, requests, eos_token_id=6), steps=5)
        batch = self.build(sampler, requests, eos_token_id=6)
        before = self._run_steps(sampler, batch, steps=2)
        batch.remove("s-topk")          # a middle request: the last rows move into its place
        after = self._run_steps(sampler, batch, steps=3, first_step=2)
        for key, tokens in after.items():
            got = before[key] + tokens
            if got != straight[key]:
                violation("remove", f"{self.describe_request(requests, *key)} drew {got} when "
                                    f"request 's-topk' left after 2 steps, {straight[key]} "
                                    f"otherwise (now at row {batch.rows.index(key)}; "
                                    f"{self._first_difference(got, straight[key])})")

    def test_removing_several_requests_at_once_equals_one_at_a_time(self, sampler):
        requests = self._seeded_requests()
        # s-plain leaves row 0 (the last row moves there), s-n3 its three rows at the end,
        # s-topp a middle row that the penalty request below it moves into
        leaving = ("s-plain", "s-n3", "s-topp")
        one_by_one, at_once = (self.build(sampler, requests, eos_token_id=6) for _ in range(2))
        for batch in (one_by_one, at_once):
            self._run_steps(sampler, batch, steps=2)
        for request_id in leaving:
            one_by_one.remove(request_id)
        at_once.remove(*leaving)
        if at_once.rows != one_by_one.rows:
            violation("remove", f"remove{leaving} left rows {at_once.rows}; removing them one at "
                                f"a time left {one_by_one.rows}")
        want = self._run_steps(sampler, one_by_one, steps=3, first_step=2)
        got = self._run_steps(sampler, at_once, steps=3, first_step=2)
        for key, tokens in want.items():
            if got[key] != tokens:
                violation("remove", f"{self.describe_request(requests, *key)} drew {got[key]} "
                                    f"after remove{leaving}, {tokens} when they left one at a "
                                    f"time ({self._first_difference(got[key], tokens)})")
