"""The ``cpu`` backend's sampler: the contract's stages at close to memory speed on CPUs.

How it is built on the core. The stage order lives in one place, the core template
(``Sampler.sample_state``, ``verify_state``, ``processed_state`` with ``prepare``,
``choose_tokens`` and ``filter``); this class overrides stages, never the order:

- ``sample_state``, ``verify_state`` and ``processed_state`` cut the rows into blocks of about
  ``BLOCK_ELEMENTS`` logits (a verification block holds whole rows, all their slots) and run
  the core template on each block, with the block's view of the step state
  (:class:`~corelib_cpu.state.BlockState`: tensors sliced to the block, the block's own
  flags). One block (B = 1 to 8 at V = 128256) is one template run, nothing more.
- The value the template passes between stages is a :class:`~corelib_cpu.block.Block`: the
  block's dense logits plus the filters' candidates and pending cuts (``block``). Every stage
  reads and updates it in place, and returns it.
- The stage overrides live in one module per part of the template, each a class mixed in
  here: steps 1-8b and the plugins' stages (``logit_stages``), steps 9-13b
  (``filter_stages``), step 14 (``draw_stage``), verification (``verification``, with its
  judges in ``judge``) and step 15 (``logprob_stage``). Their docstrings say what each does
  differently from the reference.

A request's own filter order (``sampler_order``, ``temperature_last``) takes the generic
path: its rows run the reference's stages on a dense copy in its order (``run_orders``), the
other rows of the block this backend's. The stateful selectors (mirostat, adaptive-p) read
whole rows after the filter group (``sample_selected``) and run the reference's stages there;
their log-probabilities are joined across blocks for the batch's state.

Outside those generic paths nothing is allocated per step and no temporary reaches ``B x
V``: every block-sized buffer lives in the workspace, so every stage of a block runs on data
still in the cache; the facts
of a step that only change when requests join or leave (which rows use which stage,
effective parameters, blocks) are kept by the batch (``plan.StepPlan``).

Every kept set equals the reference's (the conformance suite checks it), and so do seeded
tokens. Shapes: ``B`` rows, ``V`` vocabulary, ``n`` rows of a block.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Optional

import torch
from corelib import Sampler, SamplerOutput, SamplingBatch, StepState, pipeline
from corelib.sampler import NEG_INF, Drafts, VerifyOutput, nucleus_keep

from .batch import CpuBatch
from .block import Block
from .draw_stage import DrawStage
from .filter_stages import FilterStages, sorted_desc
from .joins import join_samples, join_verifications
from .logit_stages import LogitStages
from .logprob_stage import LogprobStage
from .plan import StepPlan, make_plan, reads_logits_once
from .rowops import known_true
from .scoring import Scoring
from .state import BlockState, CpuStepState, block_states, cpu_state, rows_state
from .verification import Verification, drafts_of, undrawn_slots
from .workspace import Workspace


class CpuSampler(LogitStages, FilterStages, DrawStage, Verification, LogprobStage, Scoring, Sampler):
    """The ``cpu`` backend (see the module docstring). Block-sized buffers live in
    ``self.workspace`` (one set per thread) and serve every step.

    ``block_elements``: logits per block (rows per block = block_elements // V, at least 1;
    a verification block holds whole rows: block_elements / (V (K + 1)) rounded, at least 1).
    """

    name = "cpu"
    default_device = "cpu"
    batch_class = CpuBatch
    #: Logits per block: 4 MiB of float32, so a block's few live copies stay in L2/L3.
    BLOCK_ELEMENTS = 1 << 20
    #: The filter stages before steps 12-13 (which may divide the top-k candidates only).
    TOP_K_AT = [stage.name for stage in pipeline.stages_in("filter")].index("top_k_top_p")

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None,
                 block_elements: Optional[int] = None):
        super().__init__(device, generator)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on CPU tensors, got device {self.device}")
        self.block_elements = int(block_elements or self.BLOCK_ELEMENTS)
        if self.block_elements < 1:
            raise ValueError(f"block_elements must be >= 1, got {block_elements!r}")
        self.workspace = Workspace()
        self._offsets: dict[int, torch.Tensor] = {}
        self._stage_methods: dict[str, Callable] = {}

    #: Steps of at most this many logits (B = 1 at V = 151936, B = 2 at 128256) run on one
    #: torch thread, whatever the caller set (``one_thread``): their operator calls are too
    #: small to split, and on a machine whose cores are busy each parallel region waits for
    #: every thread (measured: 0.3 ms steps became 12-48 ms with 2 threads on 2 busy vCPUs).
    #: 0 leaves the caller's threads on every step.
    ONE_THREAD_ELEMENTS = 1 << 18

    def sample_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        """Steps 1-15: the core template (``Sampler.sample_state``) on each block of rows.
        Ids that ``flag_invalid`` knew to be every row's real token are marked on the batch
        (``mark_sampled_ids``): their ``append`` reads nothing back to check them."""
        if more_threads_than_one(s.num_rows * s.vocab_size <= self.ONE_THREAD_ELEMENTS):
            with one_thread():
                out = self.sample_blocks(logits, batch, s)
        else:
            out = self.sample_blocks(logits, batch, s)
        workspace = self.workspace
        if out.token_ids is workspace.sampled_ids:
            batch.mark_sampled_ids(out.token_ids)
        workspace.sampled_ids = workspace.true_flags = None
        return out

    def sample_blocks(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        outputs = []
        for bs in self.block_states(logits, batch, s):
            outputs.append(Sampler.sample_state(self, logits, batch, bs))
        return outputs[0] if len(outputs) == 1 else join_samples(outputs)

    def verify_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     drafts: Drafts) -> VerifyOutput:
        """Verification: the core template (``Sampler.verify_state``) on each block of whole
        rows (every slot of a row in the same block), with the block's drafts."""
        S = drafts.slots
        outputs = []
        for bs in self.block_states(logits, batch, s, slots=S):
            rows = slice(bs.plan.r0 // S, bs.plan.r1 // S)
            block_drafts = drafts_of(drafts, rows)
            bs.undrawn = undrawn_slots(bs.plan, block_drafts)
            outputs.append(Sampler.verify_state(self, logits, batch, bs, block_drafts))
        return outputs[0] if len(outputs) == 1 else join_verifications(outputs)

    def processed_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """Steps 2-13b (``Sampler.processed_state``) on each block, into a new float32 [B, V]."""
        out = torch.empty((s.num_rows, s.vocab_size), dtype=torch.float32)
        if s.num_rows == 0:
            return out
        for bs in self.block_states(logits, batch, s):
            out[bs.plan.r0:bs.plan.r1] = Sampler.processed_state(self, logits, batch, bs)
        return out

    def sample_selected(self, x: Block, s: StepState) -> tuple[torch.Tensor, Block, torch.Tensor]:
        """Steps 10-14 when a row uses a stateful selector (``Sampler.sample_selected``): the
        filter group, its result written out whole (the selectors read every row in full),
        the log-probabilities the batch advances the state from (a new float32 [n, V]: the
        batch keeps it until ``append``, past this block's workspace), the selectors, the
        draw."""
        filtered = self.filter(x, s)
        filtered.materialize()
        logp = filtered.source = torch.log_softmax(filtered.x, dim=-1)
        final = self.select(filtered, s, logp)
        return self.draw(final, s), final, logp

    def flag_invalid(self, valid: torch.Tensor, finite: torch.Tensor,
                     token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Sampler.flag_invalid``; when the host already knows every row of the block is
        valid (steps 1-8a: ``neutralise_rows``' flag; the draw: ``finite`` is the candidate
        race's new flags, all true, ``Workspace.true_flags``, or one of the shared all-true
        marks, ``rowops.known_true``), those flags (or a new all-true bool [n]) and
        ``token_ids`` as they are (new, never a buffer): no operator call, or one, where the
        template's pair of passes is two. Those ids, every row's token in ``[0, V)``, are
        noted for ``sample_state`` (``Workspace.sampled_ids``)."""
        workspace = self.workspace
        fresh = finite is workspace.true_flags
        if workspace.rows_valid and (fresh or known_true(finite)):
            workspace.sampled_ids = token_ids
            return (finite if fresh else torch.ones(token_ids.shape[0], dtype=torch.bool)), token_ids
        return Sampler.flag_invalid(self, valid, finite, token_ids)

    def selector_slot_state(self, logp: torch.Tensor, s: StepState) -> StepState:
        """``Sampler.selector_slot_state`` on a block (whole rows: a block never splits a
        row's slots): the core's recurrence on the block's rows as a step state, its new
        selector state set on a copy of the block's."""
        if not isinstance(s, BlockState):
            return Sampler.selector_slot_state(self, logp, s)
        moved = Sampler.selector_slot_state(self, logp, s.as_step_state())
        return s.with_fields({f.name: getattr(moved, f.name) for f in pipeline.state_fields()})

    def run_orders(self, x: Block, s: StepState) -> Block:
        """The filter group when some row orders it its own way (``Sampler.run_orders``): the
        block's rows in the default order run this backend's stages; each random row with
        another order (``s.filter_order`` > 0) is handed to the generic path: its logits
        before the group, filtered by the reference's stages in its order (``dense_orders``),
        replace what the default order left for it. A block without such a row runs the
        default order alone."""
        orders = x.plan.order_rows
        if not orders:
            return self.run_group("filter", x, s)
        before = {k: x.x.index_select(0, x.plan.index(rows)) for k, rows in orders.items()}
        x = self.run_group("filter", x, s)
        names = dict(s.filter_orders)
        for k, rows in orders.items():
            x.replace_rows(rows, self.dense_order(before[k], rows_state(s, x.plan.index(rows)), names[k]))
        return x

    def dense_order(self, y: torch.Tensor, s: StepState, names: tuple) -> torch.Tensor:
        """The filter group in the order ``names`` (``sampler_order`` names) on dense rows y
        float32 [m, V] by the reference's stages (``Sampler.run_orders``' inner loop), with
        ``s`` the rows' step state. Returns a new float32 [m, V]; y is not written."""
        for name in names:
            stage, switch = pipeline.named_switch(name)
            if getattr(s, switch.flag):
                one = self.switch_state(s, stage, switch)
                fast = _DENSE_FAST.get(name)
                y = fast(y, one) if fast is not None else getattr(Sampler, stage.method)(self, y, one)
        return y

    def run_group(self, group: str, x: Block, s: StepState) -> Block:
        """``Sampler.run_group``; for the filter and select groups, whose flags only change
        when requests join or leave (the block's plan's and the batch's), the methods of the
        stages the block runs are listed once per plan (``BlockPlan.groups``) instead of
        testing every stage's flags on every step (the table grows; a step's host time
        should not)."""
        plan = getattr(s, "plan", None)
        if group not in _CACHED_GROUPS or plan is None:
            return Sampler.run_group(self, group, x, s)
        methods = plan.groups.get(group)
        if methods is None:
            methods = plan.groups[group] = tuple(
                self.stage_method(stage) for stage, flags in pipeline.flagged_stages_in(group)
                if any(getattr(s, flag) for flag in flags))
        for method in methods:
            x = method(x, s)
        return x

    def stage_method(self, stage: pipeline.Stage) -> Callable[[Block, StepState], Block]:
        """This backend's method for ``stage``; for a stage it does not override, the reference
        method on the block's rows written out whole (``run_dense``), so a stage new to the
        table runs here the day it is added, correctly if not at this backend's speed."""
        method = self._stage_methods.get(stage.name)
        if method is None:
            method = getattr(self, stage.method)
            if not self.overrides(stage):
                method = functools.partial(self.run_dense, stage, method)
            self._stage_methods[stage.name] = method
        return method

    def overrides(self, stage: pipeline.Stage) -> bool:
        """Whether this class has its own method for ``stage`` (else the reference's runs)."""
        return getattr(type(self), stage.method) is not getattr(Sampler, stage.method)

    def whole_rows_first(self, s: StepState) -> bool:
        """Whether a stage this class does not override runs before steps 12-13 in the step of
        ``s`` (``BlockPlan.whole_rows_first``); read when a plan is made, not every step."""
        return any(stage.enabled(s) and not self.overrides(stage)
                   for stage in pipeline.stages_in("filter")[:self.TOP_K_AT])

    def run_dense(self, stage: pipeline.Stage, method: Callable, x: Block, s: StepState) -> Block:
        """``method`` (a reference stage: float32 [n, V] -> a new float32 [n, V]) on the block's
        rows written out whole (``Block.densify``: cuts applied, candidates written out; the
        random rows for a filter); its result becomes the block's x."""
        bp = x.plan
        random = stage.rows == pipeline.RANDOM_ROWS
        rows = bp.random_rows if random else list(range(bp.n))
        x.densify(rows)
        for row in rows:       # x holds their cuts now: the draw must read the stage's result
            x.cuts.pop(row, None)
            x.masked.discard(row)
        out = method(x.own(), s)
        if random and bp.any_greedy:
            # greedy rows keep step 8a's logits: their processed logprobs read them here
            greedy = bp.index(bp.greedy_rows)
            out.index_copy_(0, greedy, x.x.index_select(0, greedy))
        x.x, x.owned = out, True
        x.changed()
        x.dropped = True
        return x

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts) -> StepState:
        """The verification state; a ``CpuBatch`` gives each slot its penalty slots and leaves
        out the dense penalty state (``[B (K+1), V]`` copies this backend never reads)."""
        if isinstance(batch, CpuBatch):
            return batch.speculative_state(drafts.token_ids, slots_only=True)
        return super().speculative_step_state(batch, drafts)

    def block_states(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     slots: int = 1) -> list[BlockState]:
        """The step's blocks, each as the state the template runs on (``slots``: verification
        slots per row, which a block never splits)."""
        s = cpu_state(s)
        plan = self.plan(logits, batch, s, slots)
        keys = plan.row_keys(s)
        logits_rows = s.logits_rows
        if logits_rows is None and logits.shape[0] != s.num_rows:
            logits_rows = batch.request_index(s.num_rows)
        return block_states(s, plan.blocks, keys, logits_rows, None if keys is None else plan.keys_array)

    def plan(self, logits: torch.Tensor, batch: SamplingBatch, s: CpuStepState, slots: int = 1) -> StepPlan:
        """The step's host facts (see ``plan.StepPlan``), kept by a ``CpuBatch`` until its
        rows change."""
        if reads_logits_once(s):      # blocks would buy no cache reuse, only their overhead
            rows_per_block = max(1, s.num_rows)
        elif slots == 1:
            rows_per_block = max(1, self.block_elements // s.vocab_size)
        else:   # whole rows of K + 1 slots: the nearest count to block_elements
            rows_per_block = max(1, round(self.block_elements / (s.vocab_size * slots))) * slots
        sparse = s.any_penalties and s.slot_ids is not None
        build = lambda: make_plan(s, rows_per_block, sparse, self.whole_rows_first(s))  # noqa: E731
        if isinstance(batch, CpuBatch):
            return batch.cached_plan((s.num_rows, rows_per_block, slots), build)
        return build()


_THREADS = threading.Lock()
_THREADS_HELD = [0, 0]             # steps inside one_thread now, the threads to restore


def more_threads_than_one(small: bool) -> bool:
    """Whether a step of this size (``small``: at most ``ONE_THREAD_ELEMENTS`` logits) should
    run inside ``one_thread``: the caller runs torch on more than one thread, or another
    step holds it at one. One cheap call on the common path (one thread already)."""
    # the same calls whichever branch (a step's Python work must not depend on its size)
    return (torch.get_num_threads() > 1 or _THREADS_HELD[0] > 0) and small


@contextlib.contextmanager
def one_thread():
    """Runs its body on one torch intra-op thread, restoring the caller's count after. Steps
    of several Python threads share it: the first to enter saves the count, the last to
    leave restores it (torch's count is the process's)."""
    with _THREADS:
        if _THREADS_HELD[0] == 0:
            _THREADS_HELD[1] = torch.get_num_threads()
            torch.set_num_threads(1)
        _THREADS_HELD[0] += 1
    try:
        yield
    finally:
        with _THREADS:
            _THREADS_HELD[0] -= 1
            if _THREADS_HELD[0] == 0:
                torch.set_num_threads(_THREADS_HELD[1])


def dense_top_k(x: torch.Tensor, s: StepState) -> torch.Tensor:
    """``Sampler.apply_top_k`` without its full sort: the k-th largest value of each row
    from ``torch.topk`` of the largest k (the same value the sort puts there), then the
    reference's comparison. x float32 [m, V]; not in place."""
    V = x.shape[-1]
    k = s.top_k.to(torch.long).clamp(max=V)
    width = max(int(k.max()), 1)
    kth = torch.topk(x, width, dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
    return x.masked_fill(~((x >= kth) | (k == 0)[:, None]), NEG_INF)


def dense_top_p(x: torch.Tensor, s: StepState) -> torch.Tensor:
    """``Sampler.apply_top_p`` with the probabilities ordered by numpy's vectorised sort (the
    same descending values as torch's sort) and the reference's nucleus rule
    (``nucleus_keep``). x float32 [m, V]; not in place."""
    probs = torch.softmax(x, dim=-1)
    ordered = sorted_desc(probs).to(torch.float32)
    return x.masked_fill(~nucleus_keep(probs, ordered, s.top_p), NEG_INF)


#: The generic path's faster exact forms of the reference's sorting filters, by order name.
_DENSE_FAST = {"top_k": dense_top_k, "top_p": dense_top_p}

#: The template's groups whose stage flags are fixed for a plan's life (see ``run_group``).
_CACHED_GROUPS = ("filter", "select")
