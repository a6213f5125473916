"""The fourth release on the tpu backend: the new filters (dynamic temperature, smoothing,
top-a, epsilon, eta, tail-free, p-less) traced in the step graph, per-request filter orders as
traced orders (``corelib_tpu.orders``), and mirostat v2 / adaptive-p with their state in the
batch's device columns, each against the reference sampler on the same logits; then the
compile discipline: after a warm-up that names the orders, nothing compiles."""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams
from corelib.sampler import Sampler

from corelib_tpu.layout import Variant
from corelib_tpu.orders import FilterOrders
from corelib_tpu.sampler import RecompilationError, TpuSampler

from tpu_support import compile_count, needs_xla, xla_device

DEVICES = ["cpu", pytest.param("xla", marks=needs_xla)]
REF = Sampler("cpu")
V = 96

ORDER = ["top_k", "min_p", "temperature"]
#: Requests that use every new filter, both selectors and several orders in one batch.
REQUESTS = [
    ("dyn", SamplingParams(seed=1, temperature=0.9, dynatemp_range=0.6, dynatemp_exponent=1.5)),
    ("smooth", SamplingParams(seed=2, smoothing_factor=0.4, smoothing_curve=2.0, top_a=0.1)),
    ("cuts", SamplingParams(seed=3, epsilon_cutoff=0.01, eta_cutoff=0.005, temperature=1.2)),
    ("tfs", SamplingParams(seed=4, tfs=0.8, p_less="plain")),
    ("norm", SamplingParams(seed=5, p_less="norm", top_k=40)),
    ("miro", SamplingParams(seed=6, mirostat_tau=3.0, mirostat_eta=0.2, top_k=60, n=2)),
    ("adapt", SamplingParams(seed=7, adaptive_p_target=0.3, adaptive_p_decay=0.8, min_p=0.02)),
    ("order", SamplingParams(seed=8, temperature=0.6, top_k=30, min_p=0.05, sampler_order=ORDER)),
    ("last", SamplingParams(seed=9, temperature=0.5, temperature_last=True, top_p=0.8,
                            smoothing_factor=0.2)),
    ("order-miro", SamplingParams(seed=10, temperature=1.5, top_p=0.9, mirostat_tau=4.0,
                                  sampler_order=["temperature", "top_p", "tfs"], tfs=0.9)),
    ("greedy", SamplingParams(temperature=0.0, tfs=0.5)),
    ("plain", SamplingParams(seed=11)),
]


def _device(name: str) -> torch.device:
    return xla_device() if name == "xla" else torch.device("cpu")


def _batches(sampler: TpuSampler, requests=REQUESTS):
    mine, ref = sampler.new_batch(V), REF.new_batch(V)
    for rid, params in requests:
        mine.add(rid, params)
        ref.add(rid, params)
    return mine, ref


def _logits(rows: int, step: int, slots: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn((rows, slots, V) if slots else (rows, V), generator=gen) * 2.5


def _same_state(mine, ref) -> None:
    for rid in ref.request_ids:
        got, want = mine.sampler_state(rid), ref.sampler_state(rid)
        assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want)), rid
        for g, w in zip(got, want):
            assert g == pytest.approx(w, rel=1e-5, abs=1e-6), f"{rid}: {got} != {want}"


@pytest.mark.parametrize("device", DEVICES)
def test_processed_logits_equal_the_reference(device):
    """Every new filter, both selectors and three orders in one batch: the kept sets are the
    reference's exactly, the values within float32 rounding."""
    sampler = TpuSampler(_device(device), buckets=(16,))
    mine, ref = _batches(sampler)
    for step in range(3):
        x = _logits(mine.num_rows, step)
        got = sampler.processed_logits(x.to(sampler.device), mine).cpu()
        want = REF.processed_logits(x, ref)
        for row in range(want.shape[0]):
            assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want[row])), \
                f"step {step}, row {row} ({mine.rows[row]}): kept sets differ"
        kept = torch.isfinite(want)
        torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-5)
        out = REF.sample(x, ref)
        REF.sample(x, ref)          # no advance: processed_logits keeps no source
        sampler.sample(x.to(sampler.device), mine)
        mine.append(out.token_ids)
        ref.append(out.token_ids)
    _same_state(mine, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_and_selector_state_follow_rows(device):
    """Seeded draws equal the reference's step after step while requests leave, rows swap and a
    request joins; the selectors' state follows its rows; a request moved to another batch
    with ``sampler_state`` draws what it would have drawn uninterrupted."""
    sampler = TpuSampler(_device(device), buckets=(16,))
    mine, ref = _batches(sampler)
    history: dict = {rid: [[] for _ in range(p.n)] for rid, p in REQUESTS}
    for step in range(8):
        if step == 2:
            for batch in (mine, ref):
                batch.remove("cuts")
                batch.swap_rows(0, 5)
        if step == 4:
            for batch in (mine, ref):
                batch.add("late", SamplingParams(seed=12, mirostat_tau=2.0))
            history["late"] = [[]]
        x = _logits(mine.num_rows, step)
        got = sampler.sample(x.to(sampler.device), mine).token_ids
        want = REF.sample(x, ref).token_ids
        assert got.tolist() == want.tolist(), f"step {step}"
        mine.append(got)
        ref.append(want)
        for (rid, child), token in zip(ref.rows, want.tolist()):
            history[rid][child].append(token)
        _same_state(mine, ref)
    # move "miro" and "adapt" to fresh batches: same draws as the batch they left
    for rid in ("miro", "adapt"):
        params = dict(REQUESTS)[rid]
        state = mine.sampler_state(rid)
        assert state and all(state)
        moved = sampler.new_batch(V)
        moved.add(rid, params, output_token_ids=history[rid] if params.n > 1 else history[rid][0],
                  sampler_state=state)
        x = _logits(mine.num_rows, 99)
        rows = [i for i, (r, _) in enumerate(mine.rows) if r == rid]
        stayed = sampler.sample(x.to(sampler.device), mine).token_ids[rows]
        there = sampler.sample(x[rows].to(sampler.device), moved).token_ids
        assert there.tolist() == stayed.tolist(), rid


@pytest.mark.parametrize("device", DEVICES)
def test_verify_advances_each_slots_state_as_append_would(device):
    """verify with mirostat and adaptive-p rows: the emitted tokens are the reference's, and
    appending them advances the state as the reference's append does."""
    K = 3
    sampler = TpuSampler(_device(device), buckets=(8,), speculative_k=(K,))
    requests = [r for r in REQUESTS if r[0] in ("miro", "adapt", "order-miro", "plain", "greedy")]
    mine, ref = _batches(sampler, requests)
    for step in range(3):
        n = mine.num_rows
        x = _logits(n, step, slots=K + 1)
        drafts = torch.randint(0, V, (n, K), generator=torch.Generator().manual_seed(step))
        drafts[:, :2] = x[:, :2].argmax(dim=-1)          # some drafts pass
        got = sampler.verify(x.to(sampler.device), mine, drafts)
        want = REF.verify(x, ref, drafts)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
        mine.append(got.token_ids)
        ref.append(want.token_ids)
        _same_state(mine, ref)


def test_filter_orders_registry():
    """A traced order serves every request whose enabled filters appear in it in order; one it
    does not serve is added; bad names are refused naming ``orders``."""
    orders = FilterOrders([ORDER, "temperature_last"])
    assert orders.traced[0] == tuple(ORDER)
    assert orders.traced[1][-2:] == ("temperature", "smoothing")
    assert orders.index(None) == 0
    assert orders.index(("top_k", "temperature")) == 1
    assert orders.index(("min_p", "temperature")) == 1
    assert orders.index(("top_p", "xtc", "temperature")) == 2
    assert orders.index(("temperature", "top_k")) == 3 and len(orders) == 3
    for bad in (["top_k", "nope"], ["top_k", "top_k"], "other"):
        with pytest.raises(ValueError, match="orders"):
            FilterOrders([bad])


@needs_xla
def test_after_warmup_with_orders_and_selectors_nothing_compiles():
    """Warm-up with two orders and the selectors: at most 4 step graphs per bucket (greedy
    with and without logprobs, random without and with the selectors), each random one tracing
    both orders; then steps mixing the new filters, selectors, both orders and the default
    one, with verify, joins, leaves and swaps, compile nothing. An order warm-up was not told
    of would trace a new graph: strict mode refuses it."""
    K = 2
    sampler = TpuSampler(xla_device(), buckets=(8, 16), speculative_k=(K,), dry_window=32, strict=True)
    report = sampler.warmup(V, orders=[ORDER, ["temperature", "top_p", "tfs"], "temperature_last"])
    assert report.variants == 4
    for bucket in (8, 16):
        assert report.step_graphs[("sample", bucket)] <= 4, report.step_graphs
    mine = sampler.new_batch(V)
    before = compile_count()
    live = list(REQUESTS[:6])
    for rid, params in live:
        mine.add(rid, params)
    for step in range(12):
        if step == 3:
            mine.remove("dyn")
            for rid, params in REQUESTS[6:10]:
                mine.add(rid, params)
        if step == 6:
            mine.swap_rows(1, 4)
        if step == 8:
            mine.add("g", SamplingParams(temperature=0.0))
        n = mine.num_rows
        if step % 3 == 2:
            # logits padded to the bucket: the layout that needs no padding graph
            x = _logits(mine.bucket(), step, slots=K + 1).to(xla_device())
            drafts = torch.full((mine.bucket(), K), -1)
            drafts[:n] = torch.randint(0, V, (n, K))
            out = sampler.verify(x, mine, drafts)
        else:
            out = sampler.sample(_logits(n, step).to(xla_device()), mine)
        mine.append(out.token_ids)
        assert mine.variant().orders == sampler.orders.traced
    assert compile_count() == before
    assert sampler.guard.compiled_after_warmup == 0
    # top-p before top-k: neither the default order nor a traced one has them so
    mine.add("new-order", SamplingParams(seed=3, top_k=20, top_p=0.9, sampler_order=["top_p", "top_k"]))
    assert len(sampler.orders) == 4
    with pytest.raises(RecompilationError, match=r"sample \(bucket 16"):
        sampler.sample(_logits(mine.num_rows, 50).to(xla_device()), mine)


def test_variants_without_selectors_or_orders_are_the_three_of_before():
    """A batch that uses no new feature runs the graphs it ran before this release: the
    folded random variant without selectors and without orders."""
    sampler = TpuSampler("cpu", buckets=(8,))
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1, top_k=20, tfs=0.9))
    assert batch.variant() == Variant(True, True, (), folded=True)
    batch.add("b", SamplingParams(seed=2, mirostat_tau=3.0))
    assert batch.variant() == Variant(True, True, (), folded=True, selectors=True)
    batch.add("c", SamplingParams(seed=3, temperature=0.5, temperature_last=True, top_p=0.9))
    assert batch.variant().orders == sampler.orders.traced and len(sampler.orders) == 1
