"""The whole sampler against the reference on large vocabularies: the benchmark's configs on
flat and peaked logits, mixed batches cut into blocks, and a step's Python work that does not
grow with the vocabulary or the history."""

from __future__ import annotations

import sys

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.bench import CONFIGS, make_logits

from corelib_cpu.sampler import CpuSampler

V = 32000


def requests_for(config: dict, rows: int, seeded: bool, vocab: int = V, history: int = 40):
    g = torch.Generator().manual_seed(rows)
    out = []
    for i in range(rows):
        params = dict(config)
        if "logit_bias" in params:
            params["logit_bias"] = {t % vocab: b for t, b in params["logit_bias"].items()}
        if seeded and params.get("temperature", 1.0) > 0:
            params["seed"] = 1000 + i
        prompt = torch.randint(0, vocab, (history,), generator=g).tolist()
        # fewer generated tokens than the full config's min_tokens, so step 5 stays on
        output = torch.randint(0, vocab, (min(history // 4, 250),), generator=g).tolist()
        out.append((f"r{i}", SamplingParams(**params), prompt, output))
    return out


def build(sampler, requests, vocab: int = V, mode: str = "raw"):
    batch = sampler.new_batch(vocab, eos_token_id=2, logprobs_mode=mode)
    for rid, params, prompt, output in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=output)
    return batch


def assert_same_final_logits(got, want, what):
    kept = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), kept), f"kept sets differ: {what}"
    assert torch.equal(got[kept], want[kept]), f"kept logits differ: {what}"


@pytest.mark.parametrize("profile", ["flat", "peaked"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_bench_configs_match_the_reference(config, profile):
    cpu, reference = CpuSampler(block_elements=2 * V), Sampler("cpu")
    requests = requests_for(CONFIGS[config], rows=5, seeded=True)
    mine, ref = build(cpu, requests), build(reference, requests)
    for step in range(3):
        logits = make_logits(5, V, profile, seed=step)
        what = f"{config} {profile} step {step}"
        assert_same_final_logits(cpu.processed_logits(logits, mine),
                                 reference.processed_logits(logits, ref), what)
        got, want = cpu.sample(logits, mine), reference.sample(logits, ref)
        assert torch.equal(got.token_ids, want.token_ids), f"seeded tokens differ: {what}"
        if want.logprobs is not None:
            assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids), what
            assert torch.equal(got.logprobs.ranks, want.logprobs.ranks), what
            assert torch.allclose(got.logprobs.logprobs, want.logprobs.logprobs, atol=1e-5), what
        mine.append(got.token_ids)
        ref.append(want.token_ids)


def mixed_requests():
    return [
        ("greedy", SamplingParams(temperature=0.0, repetition_penalty=1.3), [5, 6], [7]),
        ("topk-seeded", SamplingParams(top_k=40, temperature=0.8, seed=1), [], None),
        ("topp-seeded", SamplingParams(top_p=0.8, seed=2, n=2), [1], None),
        ("minp", SamplingParams(min_p=0.1, seed=3), [], None),
        ("everything", SamplingParams(top_k=30, top_p=0.7, min_p=0.01, temperature=1.4, seed=4,
                                      frequency_penalty=0.5, logit_bias={3: 4.0}), [3, 3], [3]),
        ("plain-seeded", SamplingParams(seed=5), [], None),
        ("ties", SamplingParams(top_k=3, seed=6), [], None),
    ]


@pytest.mark.parametrize("rows_per_block", [1, 3, 100])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_mixed_batch_in_blocks_matches_the_reference(rows_per_block, mode):
    vocab = 9000
    cpu, reference = CpuSampler(block_elements=rows_per_block * vocab), Sampler("cpu")
    requests = mixed_requests()
    mine, ref = build(cpu, requests, vocab), build(reference, requests, vocab)
    logits = torch.randn(mine.num_rows, vocab, generator=torch.Generator().manual_seed(9)) * 3
    logits[-1, 100:130] = 20.0                      # 30 tokens tied at the top, top_k=3
    assert_same_final_logits(cpu.processed_logits(logits, mine),
                             reference.processed_logits(logits, ref), f"blocks of {rows_per_block}")
    for step in range(3):
        got, want = cpu.sample(logits, mine), reference.sample(logits, ref)
        seeded = [i for i, (rid, _) in enumerate(mine.rows) if rid != "greedy"]
        assert got.token_ids[seeded].tolist() == want.token_ids[seeded].tolist()
        assert int(got.token_ids[0]) == int(want.token_ids[0])           # greedy
        assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids) if want.logprobs else True
        mine.append(got.token_ids)
        ref.append(want.token_ids)


def test_per_request_logits_match_expanded_rows():
    vocab = 4000
    cpu = CpuSampler(block_elements=2 * vocab)
    requests = [("a", SamplingParams(n=3, seed=1, top_p=0.9), [], None),
                ("b", SamplingParams(n=2, seed=2, top_k=7), [], None)]
    per_request = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    expanded = per_request[torch.tensor([0, 0, 0, 1, 1])]
    got = cpu.sample(per_request, build(cpu, requests, vocab)).token_ids
    want = Sampler("cpu").sample(expanded, build(Sampler("cpu"), requests, vocab)).token_ids
    assert torch.equal(got, want)


def python_calls(fn) -> int:
    """Python and builtin function calls made by fn()."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("config", ["random", "top_p", "full"])
def test_python_work_per_step_does_not_grow_with_vocabulary_or_history(config):
    cpu = CpuSampler()
    cpu.NOISE_CHUNK = 1 << 30      # one chunk of seeded noise (chunks are rows, not tokens)
    counts = []
    for vocab, history in [(20000, 8), (120000, 8), (20000, 2000)]:
        batch = build(cpu, requests_for(CONFIGS[config], rows=4, seeded=True, vocab=vocab,
                                        history=history), vocab)
        logits = make_logits(4, vocab, "flat", seed=1)
        cpu.sample(logits, batch)                                        # warm caches
        # A top-p row whose drawn token falls outside its nucleus (about 1 in 10) finds
        # its threshold: steps differ by that, so compare the steps where none did.
        steps = []
        for _ in range(6):
            steps.append(python_calls(lambda: cpu.sample(logits, batch)))
            batch.append(cpu.sample(logits, batch).token_ids)
        counts.append(min(steps))
    assert counts[0] == counts[1] == counts[2], counts


def test_overflowing_rows_are_flagged_never_answered_with_a_dropped_token():
    # The core's example: finite logits near the float32 limit, divided by a temperature < 1,
    # become +inf; top-p then sees NaN. Whatever the stages keep, the row must be flagged
    # or its token must be one that allowed_token_ids permits.
    vocab = 600
    params = [SamplingParams(temperature=0.5, top_p=0.9, allowed_token_ids=[1, 2], seed=1),
              SamplingParams(temperature=0.5, top_k=5, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=0.5, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=0.5, min_p=0.2, allowed_token_ids=[1, 2], seed=2)]
    logits = torch.zeros(len(params), vocab)
    logits[:, 1:3] = 3e38
    for sampler in (CpuSampler(), CpuSampler(block_elements=vocab)):
        batch = sampler.new_batch(vocab)
        for i, p in enumerate(params):
            batch.add(f"r{i}", p)
        out = sampler.sample(logits, batch)
        for row in range(len(params)):
            token, ok = int(out.token_ids[row]), bool(out.valid[row])
            assert (not ok and token == -1) or (ok and token in (1, 2)), (row, token, ok)


def division_tie(T: float) -> tuple[float, float]:
    """Two adjacent float32 logits a < b with a / T == b / T (a tie made by step 10): near 2
    the inputs' spacing, divided by T < 2, is below the spacing of quotients near 1."""
    a = torch.tensor(1.99)
    for _ in range(200):
        b = torch.nextafter(a, torch.tensor(2.0))
        if float(a / T) == float(b / T):
            return float(a), float(b)
        a = b
    raise AssertionError("no tie found")


@pytest.mark.parametrize("with_greedy", [False, True])
def test_top_k_on_undivided_candidates_keeps_ties_made_by_the_temperature(with_greedy):
    vocab, T = 3000, 1.9
    a, b = division_tie(T)
    requests = [("ties", SamplingParams(top_k=1, temperature=T, seed=1), [], None),
                ("spill", SamplingParams(top_k=2, temperature=T, top_p=0.8, seed=2), [], None),
                ("plain", SamplingParams(top_k=40, temperature=0.6, top_p=0.9, seed=3), [], None)]
    if with_greedy:
        requests.append(("greedy", SamplingParams(temperature=0.0), [], None))
    cpu, reference = CpuSampler(), Sampler("cpu")
    mine, ref = build(cpu, requests, vocab), build(reference, requests, vocab)
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(4)) * 0.5
    logits[0, 10], logits[0, 20] = b, a              # k = 1 keeps both after the division
    logits[1, 100:140] = 6.0                         # 40 ties at the 2nd value: past the columns
    assert cpu.plan(logits, mine, mine.step_state()).blocks[0].candidates_only
    got = cpu.processed_logits(logits, mine)
    assert_same_final_logits(got, reference.processed_logits(logits, ref), "candidates only")
    assert torch.isfinite(got[0]).sum() == 2
    for _ in range(3):
        out, want = cpu.sample(logits, mine), reference.sample(logits, ref)
        assert torch.equal(out.token_ids, want.token_ids)
        mine.append(out.token_ids)
        ref.append(want.token_ids)


def test_the_step_plan_is_kept_until_rows_change_and_then_rebuilt():
    vocab = 2000
    cpu, reference = CpuSampler(block_elements=2 * vocab), Sampler("cpu")
    requests = [(f"r{i}", SamplingParams(top_p=0.5 + 0.1 * i, seed=i, top_k=(0, 5)[i % 2]), [], None)
                for i in range(4)]
    mine, ref = build(cpu, requests, vocab), build(reference, requests, vocab)
    g = torch.Generator().manual_seed(0)

    def step():
        logits = torch.randn(mine.num_rows, vocab, generator=g)
        out, want = cpu.sample(logits, mine), reference.sample(logits, ref)
        assert torch.equal(out.token_ids, want.token_ids)
        mine.append(out.token_ids)
        ref.append(want.token_ids)
        return cpu.plan(logits, mine, mine.step_state())

    first = step()
    assert step() is first                                   # appends keep the plan
    for change in (lambda b: b.add("new", SamplingParams(temperature=0.0), [1, 2]),
                   lambda b: b.swap_rows(0, 3),
                   lambda b: b.remove("r1"),
                   lambda b: b.add("r1", SamplingParams(min_p=0.2, seed=9, n=2), [3])):
        change(mine)
        change(ref)
        before = cpu.plan(torch.zeros(mine.num_rows, vocab), mine, mine.step_state())
        assert before is not first
        first = step()


def test_small_nuclei_fall_back_to_their_threshold_and_keep_the_distribution():
    # top_p 0.05 over flat logits: most tokens drawn from the whole row fall outside the
    # nucleus, so rows reject, find their threshold and draw again.
    from corelib.testing import chi_square_p_value
    vocab, rows = 3000, 400
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    cpu, reference = CpuSampler(generator=torch.Generator().manual_seed(6)), Sampler("cpu")
    seeded = [(f"s{i}", SamplingParams(top_p=0.05, seed=i), [], None) for i in range(8)]
    mine, ref = build(cpu, seeded, vocab), build(reference, seeded, vocab)
    for _ in range(4):
        got, want = cpu.sample(logits.expand(8, vocab), mine), reference.sample(logits.expand(8, vocab), ref)
        assert torch.equal(got.token_ids, want.token_ids)
        mine.append(got.token_ids)
        ref.append(want.token_ids)
    unseeded = [(f"u{i}", SamplingParams(top_p=0.05), [], None) for i in range(rows)]
    batch = build(cpu, unseeded, vocab)
    final = reference.processed_logits(logits.expand(rows, vocab), build(reference, unseeded, vocab))[0]
    kept = torch.isfinite(final)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(10):
        counts += torch.bincount(cpu.sample(logits.expand(rows, vocab), batch).token_ids, minlength=vocab)
    assert int(counts[~kept].sum()) == 0
    assert chi_square_p_value(counts[kept], torch.softmax(final, dim=-1)[kept]) > 1e-6


def test_rows_that_spill_past_their_candidates_after_min_p_draw_from_the_top_k():
    # min-p leaves a cut on the row; top-k then finds ties past its columns and masks the
    # whole row: the draw must use the masked row, not the min-p cut's probabilities.
    vocab = 64
    logits = torch.zeros(1, vocab)
    logits[0, :40] = 2.0                              # 40 tokens tied at the top
    logits[0, 40:] = torch.arange(24, dtype=torch.float32) * 0.01
    params = SamplingParams(top_k=3, min_p=0.05, temperature=2.3, n=3)
    cpu, reference = CpuSampler(generator=torch.Generator().manual_seed(1)), Sampler("cpu")
    mine = build(cpu, [("r", params, [], None)], vocab)
    kept = torch.isfinite(reference.processed_logits(logits, build(reference, [("r", params, [], None)], vocab)))
    for _ in range(200):
        out = cpu.sample(logits, mine)
        assert bool(out.valid.all())
        assert bool(kept[0, out.token_ids].all()), out.token_ids


def test_pending_top_p_cuts_resolved_together_keep_each_rows_threshold():
    """Rows whose top-p cuts share one record but reach apply_cuts out of the record's order
    (here a min-p row after a plain top-p row) each keep their own nucleus."""
    logits = torch.tensor([[0.1541, -0.0293, -0.2179, 0.0568, -0.1085, -0.1399, 0.0403, 0.0838],
                           [-0.0719, -0.0403, -0.0597, 0.0182, -0.0857, 0.1101, -0.1071, 0.0123]])

    def kept(sampler):
        batch = sampler.new_batch(8)
        batch.add("a", SamplingParams(top_p=0.5))
        batch.add("b", SamplingParams(top_p=0.5, min_p=0.5))
        return torch.isfinite(sampler.processed_logits(logits, batch))
    assert torch.equal(kept(CpuSampler()), kept(Sampler("cpu")))


def test_steps_that_read_their_logits_once_run_as_one_block():
    """All-greedy steps without logprobs or writing stages are one pass over the logits, so
    they run as one block whatever ``block_elements`` says (verification too: every slot of
    every row); other steps keep their blocks. Tokens and drafts' verdicts are the
    reference's either way."""
    vocab = 1500
    cpu, reference = CpuSampler(block_elements=2 * vocab), Sampler("cpu")
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7))
    slots = torch.randn(6, 3, vocab, generator=torch.Generator().manual_seed(8))
    drafts = slots[:, :2].argmax(dim=-1)
    drafts[1, 0] = (drafts[1, 0] + 1) % vocab                       # row 1 rejects its first draft
    drafts[2, 1] = -1                                                # row 2 has one draft
    for extra, one_block in ((dict(), True), (dict(logprobs=2), False),
                             (dict(repetition_penalty=1.3), False)):
        requests = [(f"r{i}", SamplingParams(temperature=0.0, **extra), [5, 6], None) for i in range(6)]
        mine, ref = build(cpu, requests, vocab), build(reference, requests, vocab)
        blocks = cpu.plan(logits, mine, mine.step_state()).blocks
        assert (len(blocks) == 1) == one_block, extra
        assert torch.equal(cpu.sample(logits, mine).token_ids, reference.sample(logits, ref).token_ids)
        got, want = cpu.verify(slots, mine, drafts), reference.verify(slots, ref, drafts)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.num_emitted, want.num_emitted)


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan-slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_reads_flat_slots_where_they_are(dtype, nan):
    """verify's flat form on an all-greedy step reads the caller's rows without gathering
    them (group maxima once per source row, the argmax through the row index): tokens and
    counts equal the reference's on the padded slots, ties included, and the caller's logits
    stay as they were. A NaN slot (its row stops before it) gathers them, as do other dtypes
    than float32; same tokens."""
    vocab, num_drafts = 20000, [3, 0, 2, 1, 3, 3]
    starts = [sum(num_drafts[:r]) + r for r in range(len(num_drafts))]
    flat = torch.randn(sum(num_drafts) + 6, vocab, generator=torch.Generator().manual_seed(9))
    flat[starts[3], [70, 17000]] = 9.0                               # a tie: the lower id wins
    if nan:
        flat[starts[4] + 2, 11] = float("nan")                       # row 4 stops before slot 2
    flat = flat.to(dtype)
    drafts = [flat[s:s + k].float().argmax(dim=-1) for s, k in zip(starts, num_drafts)]
    drafts[5][2] = (drafts[5][2] + 1) % vocab                        # row 5's last draft is wrong
    padded = torch.stack([flat[s + torch.arange(4).clamp(max=k)] for s, k in zip(starts, num_drafts)])
    padded_ids = torch.full((6, 3), -1)
    for r, d in enumerate(drafts):
        padded_ids[r, :len(d)] = d
    before = flat.clone()
    requests = [(f"g{i}", SamplingParams(temperature=0.0), [5], None) for i in range(6)]
    cpu, reference = CpuSampler(), Sampler("cpu")
    got = cpu.verify(flat, build(cpu, requests, vocab), torch.cat(drafts), num_drafts=num_drafts)
    want = reference.verify(padded, build(reference, requests, vocab), padded_ids)
    assert torch.equal(got.token_ids, want.token_ids)
    assert got.num_emitted.tolist() == want.num_emitted.tolist() == [4, 1, 3, 2, 2 if nan else 4, 3]
    assert torch.equal(flat.isnan(), before.isnan()) and torch.equal(flat.nan_to_num(), before.nan_to_num())
