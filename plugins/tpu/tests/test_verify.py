"""verify on the tpu backend: K from the configured set, the argument layouts it accepts, and
equality with the reference in each of them."""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams
from corelib.bitmask import pack_bitmask
from corelib.sampler import Sampler

from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

DEVICES = ["cpu", pytest.param("xla", marks=needs_xla)]
V = 96
REQUESTS = [
    ("s", SamplingParams(seed=1, top_k=20, top_p=0.9, logprobs=2, repetition_penalty=1.2)),
    ("g", SamplingParams(temperature=0.0, logprobs=2, dry_multiplier=1.0)),
    ("n", SamplingParams(seed=2, n=2, typical_p=0.9, logprobs=0, min_tokens=2, stop_token_ids=[3])),
]


def _device(name: str) -> torch.device:
    return xla_device() if name == "xla" else torch.device("cpu")


def _build(sampler: Sampler):
    batch = sampler.new_batch(V, eos_token_id=5)
    for rid, params in REQUESTS:
        batch.add(rid, params, prompt_token_ids=[1, 2, 3, 2])
    return batch


def _arguments(K: int, seed: int = 0):
    """logits [4, K+1, V], drafts [4, K] (row 2 proposes fewer, some drafts right), draft
    probabilities [4, K, V] and a token bitmask [4, K+1, W]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((4, K + 1, V), generator=gen) * 3
    drafts = torch.argmax(logits[:, :K], dim=-1)                    # the greedy row's right ones
    drafts[0, 1:] = torch.randint(0, V, (K - 1,), generator=gen)
    drafts[2, 1:] = -1
    probs = torch.softmax(torch.randn((4, K, V), generator=gen), dim=-1)
    allowed = torch.rand((4, K + 1, V), generator=gen) < 0.7
    allowed |= torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), V).bool()
    return logits, drafts, probs, pack_bitmask(allowed)


def _same(got, want, what: str) -> None:
    assert torch.equal(got.token_ids, want.token_ids), \
        f"{what}: {got.token_ids.tolist()} vs {want.token_ids.tolist()}"
    assert torch.equal(got.num_emitted, want.num_emitted) and torch.equal(got.valid, want.valid), what
    assert got.logprobs.token_ids.shape == want.logprobs.token_ids.shape, what
    n = want.num_emitted
    for row in range(len(n)):
        k = int(n[row])
        assert torch.equal(got.logprobs.token_ids[row, :k], want.logprobs.token_ids[row, :k]), what
        torch.testing.assert_close(got.logprobs.logprobs[row, :k], want.logprobs.logprobs[row, :k],
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True], ids=["no-probs", "probs"])
def test_k_between_configured_values_runs_in_the_next_graph(device, with_probs):
    """K = 3 in a sampler compiled for K in (2, 5) runs in the K = 5 graph: its extra slots hold
    no draft and are cut, so seeded and greedy rows emit the reference's tokens."""
    dev = _device(device)
    sampler = TpuSampler(dev, buckets=(8,), speculative_k=(2, 5), dry_window=16)
    logits, drafts, probs, mask = _arguments(3)
    q = probs if with_probs else None
    got = sampler.verify(logits.to(dev), _build(sampler), drafts.to(dev),
                         None if q is None else q.to(dev), mask.to(dev))
    want = Sampler("cpu").verify(logits, _build(Sampler("cpu")), drafts, q, mask)
    assert got.token_ids.shape == (4, 4)
    _same(got, want, "K=3 in the K=5 graph")


@pytest.mark.parametrize("device", DEVICES)
def test_argument_layouts_give_the_same_result(device):
    """Drafts, draft probabilities and masks on the host or the device, every argument with the
    live rows or padded to the bucket: one result."""
    dev = _device(device)
    sampler = TpuSampler(dev, buckets=(8,), speculative_k=(2,), dry_window=16)
    logits, drafts, probs, mask = _arguments(2, seed=1)
    want = sampler.verify(logits.to(dev), _build(sampler), drafts, probs, mask)

    def pad(t, fill):
        return torch.cat([t, torch.full((8 - 4, *t.shape[1:]), fill, dtype=t.dtype)])
    forms = {
        "device": (logits.to(dev), drafts.to(dev), probs.to(dev), mask.to(dev)),
        "padded host": (pad(logits, 0.0).to(dev), pad(drafts, -1), pad(probs, 0.0), pad(mask, -1)),
        "padded device": tuple(pad(t, f).to(dev) for t, f in ((logits, 0.0), (drafts, -1),
                                                              (probs, 0.0), (mask, -1))),
    }
    for what, (x, d, q, m) in forms.items():
        _same(sampler.verify(x, _build(sampler), d, q, m), want, what)


def test_k_past_the_configured_values_and_bad_settings_raise():
    sampler = TpuSampler("cpu", buckets=(8,), speculative_k=(1, 2))
    logits, drafts, _, _ = _arguments(3)
    with pytest.raises(ValueError, match=r"K=3 draft slots.*speculative_k=\(1, 2\)"):
        sampler.verify(logits, _build(sampler), drafts)
    for bad in ((0,), (2, -1), (True,), (1.5,)):
        with pytest.raises(ValueError, match="speculative_k must hold positive ints"):
            TpuSampler("cpu", speculative_k=bad)


def test_without_configured_k_each_k_gets_its_own_graph():
    """The default (no speculative_k): any K runs, in a graph of its own size."""
    sampler = TpuSampler("cpu", buckets=(8,))
    for K in (1, 3):
        logits, drafts, probs, mask = _arguments(K, seed=K)
        got = sampler.verify(logits, _build(sampler), drafts, probs, mask)
        want = Sampler("cpu").verify(logits, _build(Sampler("cpu")), drafts, probs, mask)
        _same(got, want, f"K={K}")
