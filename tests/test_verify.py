"""Speculative verification in the reference backend: the speculative step state, the emitted
tokens, rejection sampling's edge cases, and appending a row's emitted tokens."""

import pytest
import torch

from corelib import Sampler, SamplingParams
from corelib.noise import STREAM_ACCEPT, row_keys, split_seed, stream_uniform
from corelib.drafts import DraftLayout
from corelib.sampler import Drafts

V = 40
REF = Sampler("cpu")
PROMPT = [1, 2, 3, 2, 9]
STATEFUL = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                min_tokens=4, stop_token_ids=[7], bad_words=[[5, 6], [1, 2, 3]],
                dry_multiplier=1.0, dry_allowed_length=1, dry_sequence_breakers=[0])


def build(requests, vocab=V, eos=None, sampler=REF):
    batch = sampler.new_batch(vocab, eos_token_id=eos)
    for rid, params, prompt, output in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=output)
    return batch


def tensors_of(state):
    return {k: v for k, v in vars(state).items() if isinstance(v, torch.Tensor)}


def test_speculative_state_equals_appending_the_drafts():
    requests = [("a", SamplingParams(seed=1, **STATEFUL), PROMPT, [5]),
                ("kids", SamplingParams(n=2, temperature=0.7, **STATEFUL), PROMPT, [[2, 2], [9]]),
                ("plain", SamplingParams(), [], None)]
    drafts = torch.tensor([[6, 1, 2], [2, 3, -1], [7, 7, 7], [0, -1, -1]])
    K = drafts.shape[1]
    spec = tensors_of(build(requests, eos=8).speculative_state(drafts))
    for j in range(K + 1):
        batch = build(requests, eos=8)
        for i in range(j):
            column = drafts[:, i]
            # rows with no draft at slot i stop there: their later slots are never read
            keep = column >= 0
            if keep.all():
                batch.append(column)
            else:
                batch.append(torch.stack([column, torch.full_like(column, -1)], dim=1))
        plain = tensors_of(batch.step_state())
        for name, want in plain.items():
            got = spec[name][j::K + 1]
            live = torch.tensor([(drafts[r, :j] >= 0).all().item() for r in range(4)])
            if got.dim() > 1 and got.shape[1] != want.shape[1]:         # DRY history padded for K
                got = got[:, : want.shape[1]]
            assert torch.equal(got[live], want[live]), f"{name} at slot {j}"


def test_greedy_rows_accept_drafts_while_they_equal_the_argmax():
    logits = torch.full((1, 4, V), -1.0)
    best = [3, 17, 9, 21]
    for j, t in enumerate(best):
        logits[0, j, t] = 5.0
    batch = build([("g", SamplingParams(temperature=0.0), [], None)])
    for drafts, emitted in (([3, 17, 9], [3, 17, 9, 21]), ([3, 4, 9], [3, 17, -1, -1]),
                            ([8, 17, 9], [3, -1, -1, -1]), ([3, -1, -1], [3, 17, -1, -1])):
        out = REF.verify(logits, batch, torch.tensor([drafts]))
        assert out.token_ids.tolist() == [emitted]
        assert out.num_emitted.tolist() == [sum(t >= 0 for t in emitted)]
        assert out.valid.tolist() == [True]


def test_equal_target_and_draft_distributions_accept_every_draft():
    """p == q: min(1, p/q) = 1, so every draft is accepted and the bonus token is drawn."""
    logits = torch.randn((6, 3, V), generator=torch.Generator().manual_seed(1))
    batch = build([(f"r{i}", SamplingParams(seed=i if i % 2 else None), [], None) for i in range(6)])
    p = torch.softmax(logits[:, :2], dim=-1)
    drafts = torch.multinomial(p.reshape(-1, V), 1).view(6, 2)
    out = REF.verify(logits, batch, drafts, draft_probs=p)
    assert out.num_emitted.tolist() == [3] * 6
    assert torch.equal(out.token_ids[:, :2], drafts)


def test_a_draft_the_drafter_gave_no_mass_is_still_accepted_when_the_target_likes_it():
    logits = torch.zeros((1, 2, V))
    q = torch.zeros((1, 1, V))
    q[0, 0, 1] = 1.0                               # the draft 5 has q = 0 (a drafter's bug)
    out = REF.verify(logits, build([("r", SamplingParams(seed=3), [], None)]), torch.tensor([[5]]), q)
    assert out.token_ids[0, 0].item() == 5 and out.num_emitted.item() == 2


def test_a_rejected_draft_is_replaced_from_the_residual():
    """p puts its mass on tokens 0 and 1, q on token 1 only: draft 1 is accepted with
    probability p(1)/q(1) = 1/2, and a rejection must emit token 0 (the residual)."""
    logits = torch.full((400, 2, V), -1e4)
    logits[:, :, :2] = 0.0
    q = torch.zeros((400, 1, V))
    q[:, 0, 1] = 1.0
    batch = build([(f"r{i}", SamplingParams(seed=i), [], None) for i in range(400)])
    out = REF.verify(logits, batch, torch.ones((400, 1), dtype=torch.long), q)
    rejected = out.num_emitted == 1
    assert (out.token_ids[rejected, 0] == 0).all()
    assert 150 < int(rejected.sum()) < 250      # binomial(400, 1/2): 10 sigma either side


def test_seeded_acceptance_uses_the_acceptance_stream():
    """Accept iff u * q(d) < p(d), u = stream_uniform(key(seed, child, position + j), STREAM_ACCEPT)."""
    seed, position = 99, 3
    lo, hi = split_seed(seed)
    batch = build([("r", SamplingParams(seed=seed), [], [4, 4, 4])])
    logits = torch.zeros((1, 2, V))
    q = torch.full((1, 1, V), 1.0 / V)
    q[0, 0, 7] = 2.0 / V                           # p(7)/q(7) = 1/2
    q[0, 0, 8] = 0.0
    key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, 0, position)))
    u = float(stream_uniform(key, STREAM_ACCEPT)[0])
    out = REF.verify(logits, batch, torch.tensor([[7]]), q)
    assert (out.num_emitted.item() == 2) == (u < 0.5)


def test_a_short_row_emits_the_slot_draw_after_its_drafts_not_a_residual():
    """With draft probabilities, a row with k < K drafts emits slot k's own draw after k
    acceptances, whatever the padding slots of draft_probs hold."""
    K = 3
    logits = torch.randn((1, K + 1, V), generator=torch.Generator().manual_seed(0))
    plain = build([("r", SamplingParams(seed=9), [], None)])
    first = REF.step(logits[:, 0], plain).token_ids
    second = int(REF.sample(logits[:, 1], plain).token_ids)
    drafts = torch.tensor([[int(first), -1, -1]])
    q = torch.full((1, K, V), 1.0 / V)
    q[0, 0] = 0.0
    q[0, 0, (int(first) + 1) % V] = 1.0
    q[0, 0, int(first)] = 1e-30          # p / q is huge: the draft is always accepted
    q[0, 1] = 0.0
    q[0, 1, second] = 1.0                # padding that would remove the slot's draw from a residual
    out = REF.verify(logits, build([("r", SamplingParams(seed=9), [], None)]), drafts, q)
    assert out.num_emitted.tolist() == [2]
    assert out.token_ids.tolist() == [[int(first), second, -1, -1]]


def test_a_residual_that_is_all_zero_falls_back_to_the_target():
    d = Drafts(torch.tensor([[2]]), torch.tensor([1]), None, torch.tensor([True]))
    batch = build([("r", SamplingParams(seed=1), [], None)])
    s = batch.speculative_state(d.token_ids)
    final = torch.full((2, V), float("-inf"))
    final[:, 2] = 0.0                               # p: all mass on 2; q below: the same
    q = torch.zeros((1, 1, V))
    q[0, 0, 2] = 1.0
    passed, recovered = REF.rejection_sample(final, s, Drafts(d.token_ids, d.count, q, d.usable))
    assert passed.tolist() == [[True]] and recovered.tolist() == [[2]]


def test_appending_emitted_tokens_equals_appending_them_one_by_one():
    requests = [("a", SamplingParams(**STATEFUL), PROMPT, None),
                ("b", SamplingParams(n=2, **STATEFUL), PROMPT, None)]
    emitted = torch.tensor([[5, 6, -1], [2, 2, 2], [9, -1, -1]])
    at_once = build(requests, eos=8)
    at_once.append(emitted)
    one_by_one = build(requests, eos=8)
    for j in range(3):
        one_by_one.append(emitted[:, j:j + 1])      # [rows, 1]: a -1 row does not advance
    want, got = tensors_of(one_by_one.step_state()), tensors_of(at_once.step_state())
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert at_once.generated_counts() == [2, 3, 1]


def test_verify_rejects_per_request_logits_and_leaves_caller_tensors_alone():
    batch = build([("kids", SamplingParams(n=2, seed=1), [], None)])
    with pytest.raises(ValueError, match="one row per batch row"):
        REF.verify(torch.zeros((1, 2, V)), batch, torch.tensor([[1]]))
    logits = torch.randn((2, 2, V))
    drafts = torch.tensor([[1], [2]])
    probs = torch.softmax(torch.randn((2, 1, V)), -1)
    copies = [t.clone() for t in (logits, drafts, probs)]
    REF.verify(logits, batch, drafts, probs)
    for before, after in zip(copies, (logits, drafts, probs)):
        assert torch.equal(before, after)


def test_empty_batch_verifies_nothing():
    batch = REF.new_batch(V)
    out = REF.verify(torch.zeros((0, 3, V)), batch, torch.zeros((0, 2), dtype=torch.long))
    assert out.token_ids.shape == (0, 3) and out.num_emitted.shape == (0,)


def test_draft_layout_regroups_flat_tensors():
    """Rows with 2, 0 and 3 drafts: the flat logits hold 3 + 1 + 4 rows, the drafts 5 ids;
    each row's slots past its drafts repeat its bonus row, its drafts pad with -1, and a -1
    among a row's drafts makes the rest of the row padding (another negative id stays, for
    verify to refuse or flag)."""
    layout = DraftLayout.of([2, 0, 3])
    assert (layout.max_drafts, layout.num_slots, layout.uniform) == (3, 8, False)
    logits = torch.arange(8.0)[:, None].expand(8, 5)
    assert layout.logits(logits)[:, :, 0].tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    assert layout.slot_rows.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    drafts = torch.tensor([10, 11, 20, -1, 22], dtype=torch.int32)
    assert layout.draft_token_ids(drafts).tolist() == [[10, 11, -1], [-1, -1, -1], [20, -1, -1]]
    assert layout.draft_token_ids(torch.tensor([10, -3, 20, 21, 22])).tolist() == \
        [[10, -3, -1], [-1, -1, -1], [20, 21, 22]]
    probs = torch.arange(5.0)[:, None].expand(5, 5)
    regrouped = layout.draft_probs(probs)[:, :, 0]       # slots without a draft: ignored
    assert regrouped[0, :2].tolist() == [0, 1] and regrouped[2].tolist() == [2, 3, 4]
    mask = torch.arange(8, dtype=torch.int32)[:, None]
    assert layout.bitmask(mask)[:, :, 0].tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    uniform = DraftLayout.of(torch.tensor([2, 2]))
    flat = torch.arange(6.0)[:, None].expand(6, 5)
    assert uniform.uniform and uniform.logits(flat)[:, :, 0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert uniform.logits(flat).data_ptr() == flat.data_ptr()         # a view, no copy
    empty = DraftLayout.of([])
    assert (empty.num_rows, empty.max_drafts, empty.num_slots) == (0, 0, 0)


def test_flat_verify_reads_the_logits_through_the_slot_index():
    """The reference's flat form keeps the caller's logits flat and reads each slot through
    ``StepState.logits_rows``: no row of the flat tensor is padded or copied beforehand, and
    uniform rows (every row K drafts) need no index at all."""
    seen = []

    class Recording(Sampler):
        def working_copy(self, logits, batch, s):
            seen.append((tuple(logits.shape), None if s.logits_rows is None else s.logits_rows.tolist()))
            return super().working_copy(logits, batch, s)

    sampler = Recording("cpu")
    requests = [("a", SamplingParams(seed=1), PROMPT, None), ("b", SamplingParams(temperature=0.0), PROMPT, None)]
    flat = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    sampler.verify(flat, build(requests, sampler=sampler), torch.tensor([4, 5, 6]), num_drafts=[3, 0])
    sampler.verify(flat[:4], build(requests, sampler=sampler), torch.tensor([4, 5]), num_drafts=[1, 1])
    assert seen == [((5, V), [0, 1, 2, 3, 4, 4, 4, 4]), ((4, V), None)]


def test_flat_verify_names_the_out_of_range_draft_by_its_flat_index():
    requests = [("a", SamplingParams(seed=1), PROMPT, None), ("b", SamplingParams(seed=2), PROMPT, None)]
    batch = build(requests)
    with pytest.raises(ValueError, match=r"draft_token_ids\[2\] = 40 \(row 1's draft 0, request 'b'\)"):
        REF.verify(torch.zeros(5, V), batch, torch.tensor([3, 4, 40]), num_drafts=[2, 1])
    assert batch.generated_counts() == [0, 0]


class PerSlotCopies(Sampler):
    """The reference with every ``[B, V]`` tensor copied per verification slot (the form a
    backend with its own penalty or allowed-ids stage gets)."""

    def dense_by_row(self):
        return False


@pytest.mark.parametrize("seed", range(4))
def test_per_row_dense_state_verifies_bitwise_as_per_slot_copies(seed):
    """Penalty counts and allowed masks read per row, with each slot's drafts counted on top
    (drafts repeating a token, repeating each other, padded with -1), give the tokens and the
    processed logprobs of the per-slot copies, bit for bit, and the state moves no [B, V]
    tensor per slot."""
    gen = torch.Generator().manual_seed(seed)
    K = 4
    per_row, copies = Sampler("cpu"), PerSlotCopies("cpu")
    batches = []
    for sampler in (per_row, copies):
        batch = sampler.new_batch(V, logprobs_mode="processed")
        batch.add("p", SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7,
                                      presence_penalty=-0.3, seed=5, logprobs=3, n=2),
                  prompt_token_ids=PROMPT, output_token_ids=[[4, 4, 7], [1]])
        batch.add("a", SamplingParams(allowed_token_ids=list(range(3, 30)), frequency_penalty=1.5,
                                      temperature=0.0, logprobs=2), prompt_token_ids=[3, 3])
        batch.add("g", SamplingParams(presence_penalty=2.0, temperature=0.0), output_token_ids=[9])
        batches.append(batch)
    drafts = torch.randint(0, 8, (4, K), generator=gen)           # few ids: many repeats
    drafts[1, 2:] = -1
    drafts[3, 0] = drafts[3, 1] = 4
    logits = torch.randn(4, K + 1, V, generator=gen) * 3
    s = batches[0].speculative_state(drafts, dense_by_row=True)
    assert s.slots_per_row == K + 1 and s.output_counts.shape[0] == 4 and s.allowed_mask.shape[0] == 4
    flat = logits.reshape(-1, V)
    slot_logits = [sampler.prepare(flat, batch, state)[0] for sampler, batch, state in
                   ((per_row, batches[0], s), (copies, batches[1], batches[1].speculative_state(drafts)))]
    assert torch.equal(*slot_logits)                     # every slot's logits after steps 3-8
    got, want = (sampler.verify(logits, batch, drafts) for sampler, batch in zip((per_row, copies), batches))
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.num_emitted, want.num_emitted)
    # bit for bit; slots a row never reaches hold NaN on both sides
    torch.testing.assert_close(got.logprobs.logprobs, want.logprobs.logprobs, rtol=0, atol=0,
                               equal_nan=True)
    assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids)
