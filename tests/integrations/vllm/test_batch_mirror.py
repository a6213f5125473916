"""The corelib batch follows vLLM's own persistent ``InputBatch`` through add_request,
remove_request, condense and swap_states, with every row's state moving with its request."""

from __future__ import annotations

import random

import pytest
import torch
from vllm import SamplingParams as VllmParams
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

import corelib
from corelib.integrations.vllm.sampler import BatchMirror
from corelib.noise import split_seed

VOCAB = 512
MAX_REQS = 16


class Engine:
    """vLLM's InputBatch driven the way its model runner drives it, with a BatchMirror."""

    def __init__(self, backend: str = "cpu"):
        self.input_batch = InputBatch(max_num_reqs=MAX_REQS, max_model_len=128,
                                      max_num_batched_tokens=128, device=torch.device("cpu"),
                                      vocab_size=VOCAB, block_sizes=[16],
                                      max_num_blocks_per_req=[8])
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = corelib.get_sampler(backend)
        self.mirror = BatchMirror(self.sampler, VOCAB, "raw")
        self.next_id = 0

    def new_request(self, outputs=(), **params) -> str:
        rid = f"req-{self.next_id}"
        params.setdefault("seed", 1000 + self.next_id)
        self.next_id += 1
        self.requests[rid] = CachedRequestState(
            req_id=rid, prompt_token_ids=[1, 2 + self.next_id % 50, 3], mm_features=[],
            sampling_params=VllmParams(temperature=0.8, **params), generator=None,
            block_ids=([self.next_id],), num_computed_tokens=0, output_token_ids=list(outputs))
        return rid

    def step(self, remove=(), add=(), swaps=(), preempt=()):
        """One scheduler update as the runner applies it: removals (``preempt``: out of the
        batch, its request state kept), additions (lowest free rows first), condense,
        reorders; then the mirror syncs."""
        for rid in remove:
            self.input_batch.remove_request(rid)
            del self.requests[rid]
        for rid in preempt:
            self.input_batch.remove_request(rid)
        for rid in add:
            self.input_batch.add_request(self.requests[rid])
        self.input_batch.condense()
        for a, b in swaps:
            self.input_batch.swap_states(a, b)
        self.input_batch.refresh_metadata()
        before = dict(self.mirror.moves)
        batch = self.mirror.sync(self.input_batch, self.requests)
        self.check(batch)
        return {k: self.mirror.moves[k] - before[k] for k in before}

    def decode(self, discard=()):
        """Every row gets a token; vLLM keeps all but the rows in ``discard``."""
        batch = self.mirror.batch
        tokens = torch.randint(3, VOCAB, (len(batch),))
        batch.append(tokens)
        for row, rid in enumerate(self.input_batch.req_ids):
            if rid not in discard:
                self.requests[rid].output_token_ids.append(int(tokens[row]))

    def sample(self, logits, discard=()):
        """Every row samples from ``logits`` (float32 [rows, VOCAB]); vLLM keeps all but the
        tokens of the rows in ``discard``."""
        batch = self.mirror.batch
        out = self.sampler.sample(logits[:len(batch)], batch)
        batch.append(out.token_ids)
        for row, rid in enumerate(self.input_batch.req_ids):
            if rid not in discard:
                self.requests[rid].output_token_ids.append(int(out.token_ids[row]))

    def check(self, batch):
        order = self.input_batch.req_ids
        assert batch.rows == [(rid, 0) for rid in order]
        state = batch.step_state()
        for row, rid in enumerate(order):
            request = self.requests[rid]
            assert batch.generated_counts()[row] == len(request.output_token_ids)
            assert int(state.position[row]) == len(request.output_token_ids)
            assert int(state.seed_lo[row]) == split_seed(request.sampling_params.seed)[0]


@pytest.mark.parametrize("seed", range(20))
def test_removals_alone_need_no_row_moves(seed):
    """The mirror removes in the order that makes corelib's remove (last row into the hole)
    close the holes as vLLM's condense does, so a step that only loses requests agrees
    without a swap."""
    rng = random.Random(seed)
    engine = Engine()
    engine.step(add=[engine.new_request() for _ in range(12)])
    while engine.input_batch.req_ids:
        running = list(engine.input_batch.req_ids)
        remove = rng.sample(running, rng.randint(1, min(5, len(running))))
        moves = engine.step(remove=remove)
        assert moves == {"added": 0, "removed": len(remove), "swapped": 0}


@pytest.mark.parametrize("seed", range(20))
def test_joins_and_leaves_of_one_step_need_no_swap(seed):
    """vLLM puts new requests into the lowest rows freed in the same step, in order, appends
    the others and condenses the remaining holes. The mirror adds and removes in the order
    that lands every row where vLLM has it: one ``remove`` for the leaving requests, no swap."""
    rng = random.Random(seed)
    engine = Engine()
    engine.step(add=[engine.new_request() for _ in range(rng.randint(1, 10))])
    for _ in range(8):
        running = list(engine.input_batch.req_ids)
        remove = rng.sample(running, rng.randint(0, len(running)))
        room = MAX_REQS - len(running) + len(remove)
        add = [engine.new_request() for _ in range(rng.randint(0, room))]
        if running:
            engine.decode()
        moves = engine.step(remove=remove, add=add)
        assert moves == {"added": len(add), "removed": len(remove), "swapped": 0}


def test_additions_into_holes_and_swaps_are_followed():
    engine = Engine()
    ids = [engine.new_request() for _ in range(6)]
    engine.step(add=ids)
    engine.decode()
    moves = engine.step(remove=[ids[1]], add=[engine.new_request()])
    assert moves["added"] == 1 and moves["removed"] == 1
    moves = engine.step(swaps=[(0, 3), (1, 2)])
    assert moves == {"added": 0, "removed": 0, "swapped": 2}


def test_a_discarded_token_re_adds_only_that_request():
    """A row mid-prefill samples a token that vLLM throws away: its history is taken again
    from vLLM's request state; the other rows keep theirs."""
    engine = Engine()
    ids = [engine.new_request(frequency_penalty=0.5) for _ in range(4)]
    engine.step(add=ids)
    engine.decode(discard={ids[2]})
    moves = engine.step()
    assert moves["removed"] == 1 and moves["added"] == 1


def test_steady_steps_change_nothing_and_a_changed_request_is_taken_again():
    """Steps where vLLM's batch only decodes leave the mirror's rows alone (its fast path);
    a request whose state vLLM replaced under the same id is removed and added again."""
    engine = Engine()
    ids = [engine.new_request(presence_penalty=0.5) for _ in range(5)]
    engine.step(add=ids)
    for _ in range(3):
        engine.decode()
        assert engine.step() == {"added": 0, "removed": 0, "swapped": 0}
    old = engine.requests[ids[3]]
    engine.requests[ids[3]] = CachedRequestState(
        req_id=ids[3], prompt_token_ids=old.prompt_token_ids, mm_features=[],
        sampling_params=VllmParams(temperature=0.5, seed=77), generator=None,
        block_ids=old.block_ids, num_computed_tokens=0, output_token_ids=old.output_token_ids)
    moves = engine.step()             # check() finds every row in vLLM's order and state
    assert moves["added"] == 1 and moves["removed"] == 1
    assert int(engine.mirror.batch.step_state().seed_lo[3]) == split_seed(77)[0]


def test_resumed_request_continues_from_its_output_tokens():
    engine = Engine()
    rid = engine.new_request(outputs=[7, 8, 9], presence_penalty=1.0)
    engine.step(add=[rid])
    counts = engine.mirror.batch.step_state().output_counts[0]
    assert [int(counts[t]) for t in (7, 8, 9)] == [1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_random_churn(seed):
    """Random arrivals, departures, discarded tokens and reorders for many steps."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    engine = Engine()
    for _ in range(60):
        running = list(engine.input_batch.req_ids)
        remove = rng.sample(running, rng.randint(0, min(3, len(running))))
        room = MAX_REQS - len(running) + len(remove)
        add = [engine.new_request(repetition_penalty=1.2 if rng.random() < 0.3 else 1.0,
                                  outputs=[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 3))])
               for _ in range(rng.randint(0, min(3, room)))]
        size = len(running) - len(remove) + len(add)
        swaps = [tuple(rng.sample(range(size), 2)) for _ in range(rng.randint(0, 2))] if size > 1 else []
        engine.step(remove=remove, add=add, swaps=swaps)
        if size:
            engine.decode(discard=set(rng.sample(engine.input_batch.req_ids, rng.randint(0, 1))))


def test_a_preempted_selector_resumes_its_state_and_a_discarded_token_is_undone():
    """A mirostat request that leaves unfinished keeps its state in the mirror; it resumes from
    it when it joins again with as many output tokens, also after vLLM discards the token it
    sampled during its resumed prefill; once it finishes, nothing of it stays behind."""
    engine = Engine()
    logits = torch.randn(MAX_REQS, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    ids = [engine.new_request(extra_args={"corelib": {"mirostat_tau": 3.0, "mirostat_eta": 0.4}})
           for _ in range(3)]
    engine.step(add=ids)
    for _ in range(4):
        engine.sample(logits)
        engine.step()
    batch = engine.mirror.batch
    kept = batch.sampler_state(ids[1])
    assert kept != [[6.0]]                 # mu moved from 2 * tau
    engine.step(preempt=[ids[1]])
    for _ in range(2):
        engine.sample(logits)
        engine.step()
    engine.step(add=[ids[1]])
    assert engine.mirror.resumed == 1 and batch.sampler_state(ids[1]) == kept
    engine.sample(logits, discard={ids[1]})     # its prefill is not done: vLLM drops the token
    engine.step()
    assert engine.mirror.resumed == 2 and batch.sampler_state(ids[1]) == kept
    engine.sample(logits)
    engine.step()
    moved = batch.sampler_state(ids[1])
    assert moved != kept
    engine.step(preempt=[ids[2]])           # left unfinished, then aborted while out
    del engine.requests[ids[2]]
    engine.step(remove=[ids[1]])
    assert engine.mirror._selector_states == {}


def test_a_backend_that_cannot_resume_a_state_starts_it_afresh():
    """A backend whose batch's add predates sampler_state: the preempted selector request
    comes back with a fresh state (and a warning) instead of failing the engine's step."""
    engine = Engine("reference")
    engine.mirror._resumes = False          # as such a backend's batch reports itself
    logits = torch.randn(MAX_REQS, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    rid = engine.new_request(extra_args={"corelib": {"mirostat_tau": 3.0, "mirostat_eta": 0.4}})
    engine.step(add=[rid])
    for _ in range(3):
        engine.sample(logits)
        engine.step()
    engine.step(preempt=[rid])
    engine.step(add=[rid])
    assert engine.mirror.resumed == 0
    assert engine.mirror.batch.sampler_state(rid) == [[6.0]]        # 2 * tau
