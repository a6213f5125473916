"""The filters of the fourth release, per-request filter orders and the stateful selectors on
the cpu backend against the reference: on a large vocabulary, in blocks of a few rows (orders,
greedy rows and selector rows spread over blocks), over several steps with ``append``, and in
``verify``."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams, pipeline, selectors
from corelib.bench import make_logits

from corelib_cpu.sampler import CpuSampler

V = 4096
PROMPT = [1, 2, 3, 2, 9, 100, 101]
# every filter of the group at values that drop tokens on both logit profiles
ALL_FILTERS = dict(temperature=0.8, dynatemp_range=0.4, dynatemp_exponent=1.3, top_n_sigma=3.0,
                   smoothing_factor=0.2, smoothing_curve=1.5, min_p=0.001, top_a=0.05,
                   epsilon_cutoff=1e-5, eta_cutoff=1e-4, top_k=300, top_p=0.97, typical_p=0.98,
                   tfs=0.95, p_less="norm", xtc_threshold=0.02, xtc_probability=0.5)
# each new filter by itself (and with the filters the fast paths treat specially)
ALONE = {
    "dynatemp": dict(temperature=0.9, dynatemp_range=0.5, dynatemp_exponent=1.5),
    "dynatemp_top_k": dict(temperature=0.9, dynatemp_range=0.5, top_k=50),
    "smoothing": dict(smoothing_factor=0.3, smoothing_curve=2.0),
    "smoothing_min_p": dict(smoothing_factor=0.3, min_p=0.02),
    "top_a": dict(top_a=0.2),
    "top_a_top_k": dict(top_a=0.5, top_k=40, temperature=0.7),
    "epsilon": dict(epsilon_cutoff=3e-4),
    "epsilon_top_p": dict(epsilon_cutoff=3e-4, top_p=0.8),
    "eta": dict(eta_cutoff=4e-4),
    "tfs": dict(tfs=0.7),
    "tfs_top_k": dict(tfs=0.9, top_k=30),
    "p_less": dict(p_less="plain"),
    "p_less_norm": dict(p_less="norm", temperature=1.3),
    "mirostat": dict(mirostat_tau=3.0, mirostat_eta=0.1),
    "mirostat_top_k": dict(mirostat_tau=5.0, top_k=40),
    "adaptive_p": dict(adaptive_p_target=0.3, adaptive_p_decay=0.9, min_p=0.01),
}


def build(sampler, requests, mode: str = "processed"):
    batch = sampler.new_batch(V, eos_token_id=6, logprobs_mode=mode)
    for rid, params in requests:
        batch.add(rid, params, prompt_token_ids=PROMPT, output_token_ids=[4, 5])
    return batch


def same_final(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    kept = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), kept), (
        f"kept sets differ: {what}: rows {(torch.isfinite(got) != kept).any(dim=1).nonzero().flatten().tolist()}")
    assert torch.equal(got[kept], want[kept]), f"kept logits differ: {what}"


def run_steps(requests, steps: int = 3, block_rows: int = 2, mode: str = "processed"):
    """Sample ``steps`` steps on the cpu backend (blocks of ``block_rows`` rows) and the
    reference, checking the final logits, seeded tokens and the batch's selector state."""
    cpu, reference = CpuSampler(block_elements=block_rows * V), Sampler("cpu")
    mine, ref = build(cpu, requests, mode), build(reference, requests, mode)
    for step in range(steps):
        logits = make_logits(len(requests), V, "peaked" if step % 2 else "flat", seed=step)
        what = f"step {step}"
        same_final(cpu.processed_logits(logits, mine), reference.processed_logits(logits, ref), what)
        got, want = cpu.sample(logits, mine), reference.sample(logits, ref)
        assert torch.equal(got.token_ids, want.token_ids), f"seeded tokens differ: {what}"
        if want.logprobs is not None:
            assert torch.allclose(got.logprobs.logprobs, want.logprobs.logprobs, atol=1e-5), what
        assert (got.selector_source is None) == (want.selector_source is None), what
        if want.selector_source is not None:
            random = ~mine.step_state().greedy
            assert torch.equal(got.selector_source[random], want.selector_source[random]), what
        mine.append(got.token_ids)
        ref.append(want.token_ids)
        for rid, _ in requests:
            assert mine.sampler_state(rid) == ref.sampler_state(rid), f"{rid}: {what}"


@pytest.mark.parametrize("case", sorted(ALONE))
def test_each_new_stage_matches_the_reference(case, kernel_path):
    requests = [(f"r{i}", SamplingParams(seed=10 + i, **ALONE[case])) for i in range(3)]
    requests += [("greedy", SamplingParams(temperature=0.0, **{k: v for k, v in ALONE[case].items()
                                                                if k != "temperature"})),
                 ("plain", SamplingParams(seed=3))]
    run_steps(requests)


def test_orders_of_their_own_share_blocks_with_the_default_order():
    names = [name for name in pipeline.order_names()]
    requests = [
        ("default", SamplingParams(seed=1, **ALL_FILTERS)),
        ("reversed", SamplingParams(seed=2, sampler_order=names[::-1], **ALL_FILTERS)),
        ("greedy", SamplingParams(temperature=0.0, top_k=5)),
        ("last", SamplingParams(seed=4, temperature_last=True, **ALL_FILTERS)),
        ("top_p_first", SamplingParams(seed=5, sampler_order=["top_p", "min_p", "top_k", "temperature"],
                                       temperature=1.4, top_p=0.9, min_p=0.02, top_k=100)),
        ("reversed_too", SamplingParams(seed=6, sampler_order=names[::-1], **ALL_FILTERS)),
        ("top_k_only", SamplingParams(seed=7, top_k=20, temperature=0.7)),
    ]
    for block_rows in (1, 2, 7):
        run_steps(requests, steps=2, block_rows=block_rows)


def test_selectors_keep_their_state_across_blocks_and_orders():
    requests = [
        ("miro", SamplingParams(seed=1, mirostat_tau=3.0, mirostat_eta=0.2, top_k=200)),
        ("greedy", SamplingParams(temperature=0.0)),
        ("adaptive", SamplingParams(seed=2, adaptive_p_target=0.2, adaptive_p_decay=0.8)),
        ("miro_ordered", SamplingParams(seed=3, mirostat_tau=4.0, sampler_order=["top_p", "temperature"],
                                        temperature=0.8, top_p=0.9)),
        ("plain", SamplingParams(seed=4, top_p=0.9)),
    ]
    run_steps(requests, steps=4, block_rows=2, mode="raw")


@pytest.mark.parametrize("with_probs", [False, True])
def test_verify_advances_the_selectors_per_slot_as_the_reference(with_probs):
    requests = [("miro", SamplingParams(seed=1, mirostat_tau=3.0, top_p=0.95)),
                ("adaptive", SamplingParams(seed=2, adaptive_p_target=0.3, temperature=0.9)),
                ("greedy", SamplingParams(temperature=0.0)),
                ("ordered", SamplingParams(seed=4, temperature_last=True, temperature=0.6, min_p=0.05,
                                           mirostat_tau=2.0))]
    cpu, reference = CpuSampler(block_elements=2 * 3 * V), Sampler("cpu")   # 2 rows of 3 slots
    mine, ref = build(cpu, requests), build(reference, requests)
    K = 2
    g = torch.Generator().manual_seed(5)
    logits = make_logits(len(requests) * (K + 1), V, "peaked", seed=9).view(len(requests), K + 1, V)
    drafts = torch.randint(0, 50, (len(requests), K), generator=g)
    drafts[3, 1] = -1
    probs = None
    if with_probs:
        probs = torch.softmax(torch.randn(len(requests), K, V, generator=g) * 3, dim=-1)
    got = cpu.verify(logits, mine, drafts, probs)
    want = reference.verify(logits, ref, drafts, probs)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.num_emitted, want.num_emitted)
    for batch, out in ((mine, got), (ref, want)):
        batch.append(out.token_ids)
    for rid, _ in requests:
        assert mine.sampler_state(rid) == ref.sampler_state(rid), rid


def test_compiled_tail_free_smoothing_and_adaptive_p_give_the_torch_paths_bits(monkeypatch):
    """The compiled kernels against the pure-torch code they replace, on rows that reach each
    branch: dropped tokens, a uniform row (second differences summing to 0), three and two
    kept tokens, tfs 0 and near 1; smoothing curves below 1, between 1 and 3 and above 3;
    adaptive-p aiming at 0, 1 and between, with a NaN logit; both equal to the reference."""
    import importlib.util

    from corelib_cpu import kernels
    from corelib_cpu.filter_stages import adaptive_rows_, smooth_rows_, sorted_desc, tfs_thresholds
    from corelib_cpu.workspace import Workspace
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed (the kernels extra)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3000, generator=g) * torch.tensor([0.5, 1, 2, 4, 8, 1, 1, 3])[:, None]
    x[1, ::3] = float("-inf")
    x[5] = 0.0                                           # uniform
    x[6, 3:] = float("-inf")                             # three tokens
    x[7, 2:] = float("-inf")                             # two tokens
    probs = torch.softmax(x, dim=-1)
    n = (x > float("-inf")).sum(dim=-1, keepdim=True)
    tfs = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.95, 0.9, 0.99, 0.5])
    f = torch.full((8, 1), 0.4)
    c = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 3.5, 2.5, 1.2])[:, None]
    y = x.clone()
    y[2, 7] = float("nan")
    target = torch.tensor([0.0, 0.3, 1.0, 0.05, 0.5, 0.2, 0.9, 0.4])
    weighted = torch.tensor([0.0, 0.5, 0.1, 2.0, 0.7, 0.0, 3.0, 1.3])
    total = torch.tensor([0.0, 1.9, 1.0, 2.5, 1.0, 0.0, 3.0, 4.1])
    aim = selectors.adaptive_aim(target, weighted, total)

    def adaptive():
        out = y.clone()
        adaptive_rows_(out, torch.softmax(out, dim=-1), aim, Workspace())
        return out

    kernels.reset()
    assert kernels.wanted()
    compiled = tfs_thresholds(sorted_desc(probs), n, tfs)
    smooth_compiled = x.clone()
    smooth_rows_(smooth_compiled, f, c, Workspace())
    adaptive_compiled = adaptive()
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    kernels.reset()
    try:
        plain = tfs_thresholds(torch.sort(probs, dim=-1, descending=True).values.double(), n, tfs)
        smooth_plain = x.clone()
        smooth_rows_(smooth_plain, f, c, Workspace())
        adaptive_plain = adaptive()
    finally:
        monkeypatch.delenv(kernels.KERNELS_ENV)
        kernels.reset()
    assert torch.equal(compiled, plain)
    assert torch.equal(smooth_compiled, smooth_plain)
    torch.testing.assert_close(adaptive_compiled, adaptive_plain, rtol=0, atol=0, equal_nan=True)
    reference = Sampler("cpu")
    assert torch.equal(smooth_plain, reference.apply_smoothing(
        x, _Fields(smoothing_factor=f[:, 0], smoothing_curve=c[:, 0])))
    shaped = reference.apply_adaptive_p(y, _Fields(adaptive_p_target=target, adaptive_p_weighted=weighted,
                                                   adaptive_p_total=total))
    torch.testing.assert_close(adaptive_plain, shaped, rtol=0, atol=0, equal_nan=True)
    assert bool((adaptive_plain[1, ::3] == float("-inf")).all()) and bool(adaptive_plain[2, 7].isnan())


class _Fields:
    def __init__(self, **values):
        self.__dict__.update(values)
