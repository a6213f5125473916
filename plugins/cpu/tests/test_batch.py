"""CpuBatch's penalty slots always describe the same state as the core's dense tensors, through
add (with resumed outputs), append, remove (rows moving into holes) and regrowth."""

from __future__ import annotations

import torch
from corelib import SamplingParams

from corelib_cpu.batch import CpuBatch

V = 500
PEN = dict(repetition_penalty=1.2, frequency_penalty=0.3)


def slot_state(batch: CpuBatch) -> list[dict]:
    ids, counts, length = batch.penalty_slots(batch.num_rows)
    return [dict(zip(ids[r, : length[r]].tolist(), counts[r, : length[r]].tolist()))
            for r in range(batch.num_rows)]


def dense_state(batch: CpuBatch) -> list[dict]:
    s = batch.step_state()
    out = []
    for r in range(batch.num_rows):
        rid, _ = batch.rows[r]
        if not batch.params_of(rid).uses_penalties:
            out.append({})
            continue
        seen = s.prompt_mask[r] | (s.output_counts[r] > 0)
        tokens = seen.nonzero().flatten().tolist()
        out.append({t: int(s.output_counts[r, t]) for t in tokens})
    return out


def test_slots_follow_the_dense_state_through_churn():
    g = torch.Generator().manual_seed(0)
    batch = CpuBatch(V)
    batch.add("plain", SamplingParams(), [1, 2, 3])
    batch.add("a", SamplingParams(**PEN), [5, 6, 5, 7])
    batch.add("kids", SamplingParams(n=3, presence_penalty=0.5),
              list(range(100, 180)), [[1, 1], [], [2, 9, 2]])
    batch.add("b", SamplingParams(**PEN), [], [4, 4, 4])
    assert slot_state(batch) == dense_state(batch)
    for step in range(40):
        batch.append(torch.randint(0, 60, (batch.num_rows,), generator=g))
        assert slot_state(batch) == dense_state(batch), f"step {step}"
        if step == 10:
            batch.remove("a")                       # rows after it move into its hole
            assert slot_state(batch) == dense_state(batch)
        if step == 20:
            # many new distinct tokens per row: the slots widen past their first size
            for _ in range(80):
                batch.append(torch.randint(0, V, (batch.num_rows,), generator=g))
            batch.add("resumed", SamplingParams(frequency_penalty=1.0), [7] * 5,
                      list(range(200, 300)))
        if step == 25:
            batch.swap_rows(0, batch.num_rows - 1)  # an engine reordering its batch
            assert slot_state(batch) == dense_state(batch)
        if step == 30:
            batch.remove("kids")
    assert slot_state(batch) == dense_state(batch)
    assert batch.has_penalty_slots


def test_rows_without_penalties_have_no_slots():
    batch = CpuBatch(V)
    batch.add("plain", SamplingParams(n=2), [1, 2, 3], [[4], [5]])
    assert not batch.has_penalty_slots
    batch.append([1, 2])
    assert slot_state(batch) == [{}, {}]
    batch.add("pen", SamplingParams(presence_penalty=1.0), [9])
    batch.remove("pen")
    assert not batch.has_penalty_slots


def test_append_after_plain_rows_outgrow_the_slots():
    """A penalty row first, then more plain rows than the slots were made for."""
    batch = CpuBatch(V)
    batch.add("pen", SamplingParams(presence_penalty=1.0), [9])
    for i in range(12):
        batch.add(f"plain-{i}", SamplingParams(), [1])
    batch.append(torch.arange(batch.num_rows))
    assert slot_state(batch) == dense_state(batch)


def test_requests_leaving_together_leave_the_slots_of_one_at_a_time():
    g = torch.Generator().manual_seed(1)
    batches = [CpuBatch(V), CpuBatch(V)]
    for batch in batches:
        batch.add("a", SamplingParams(**PEN), [5, 6, 5, 7])
        batch.add("plain", SamplingParams(), [1, 2])
        batch.add("kids", SamplingParams(n=3, presence_penalty=0.5), list(range(100, 140)))
        batch.add("b", SamplingParams(**PEN), [], [4, 4, 4])
        batch.add("c", SamplingParams(frequency_penalty=1.0), [9])
    for step in range(5):
        tokens = torch.randint(0, 60, (batches[0].num_rows,), generator=g)
        for batch in batches:
            batch.append(tokens)
    one_by_one, at_once = batches
    for request_id in ("a", "kids", "plain"):
        one_by_one.remove(request_id)
    at_once.remove("a", "kids", "plain")
    assert at_once.rows == one_by_one.rows == [("c", 0), ("b", 0)]
    assert slot_state(at_once) == slot_state(one_by_one) == dense_state(at_once)
    at_once.remove("b", "c")                    # the last penalty requests: no slots are read
    assert not at_once.has_penalty_slots


def test_speculative_slots_are_the_state_after_each_slots_drafts():
    """Slot j of a verify (or score) state holds the row's state after its first j drafts:
    repeated drafts, drafts already seen, -1 padding and rows without penalties."""
    batch = CpuBatch(V)
    batch.add("a", SamplingParams(**PEN), prompt_token_ids=[3, 4, 5])
    batch.add("plain", SamplingParams(), prompt_token_ids=[3])
    batch.add("b", SamplingParams(**PEN), prompt_token_ids=[9], output_token_ids=[7, 7])
    batch.append(torch.tensor([4, 1, 8]))
    drafts = torch.tensor([[6, 4, 6, 11, 6, 12], [1, 2, 3, -1, -1, -1], [7, 13, 13, 9, -1, -1]])
    s = batch.speculative_state(drafts, slots_only=True)
    dense = batch.speculative_state(drafts)
    S = drafts.shape[1] + 1
    for v in range(3 * S):
        row = v // S
        if row == 1:
            continue                                   # no penalties: no slots are read
        L = int(s.slot_len[v])
        got = dict(zip(s.slot_ids[v, :L].tolist(), s.slot_counts[v, :L].tolist()))
        seen = (dense.prompt_mask[v] | (dense.output_counts[v] > 0)).nonzero().flatten().tolist()
        assert got == {t: int(dense.output_counts[v, t]) for t in seen}, (row, v % S)


def test_positions_advance_as_the_core_batch_advances_them():
    """``CpuBatch._advance_positions`` (a few rows through a memoryview, more through torch)
    leaves the positions the core batch leaves, through every-row appends, appends with a
    flagged row (-1), a request joining and one leaving (new row views), a batch past
    ``FEW_POSITIONS`` rows, and steps under ``torch.inference_mode``."""
    from corelib import SamplingBatch

    mine, ref = CpuBatch(V), SamplingBatch(V)
    for b in (mine, ref):
        b.add("a", SamplingParams(min_tokens=3), output_token_ids=[1, 2])

    def step(ids, inference=False):
        for b in (mine, ref):
            with torch.inference_mode(inference):
                b.append(torch.tensor(ids))
        assert mine.generated_counts() == ref.generated_counts()
        assert torch.equal(mine.step_state().position, ref.step_state().position)
    step([5])
    step([6], inference=True)
    step([-1])
    for b in (mine, ref):
        b.add("b", SamplingParams(), output_token_ids=[7])
    step([8, 9])
    step([10, -1])
    for b in (mine, ref):
        b.remove("a")
    step([11])
    for i in range(CpuBatch.FEW_POSITIONS + 1):
        for b in (mine, ref):
            b.add(f"c{i}", SamplingParams())
    step(list(range(mine.num_rows)))
    step(list(range(mine.num_rows)), inference=True)
    assert mine.generated_counts()[0] == 5
