"""The traced top-k / top-p / min-p / argmax building blocks against the reference stages.

Each test packs many cases into the rows of one batch (one XLA graph per function and shape),
on CPU tensors and on the XLA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from corelib.sampler import Sampler

from corelib_tpu import thresholds

from tpu_support import needs_xla, xla_device

DEVICES = ["cpu", pytest.param("xla", marks=needs_xla)]
REF = Sampler("cpu")


def _device(name: str) -> torch.device:
    return xla_device() if name == "xla" else torch.device("cpu")


def _logits(V: int, seed: int = 0) -> torch.Tensor:
    """Rows of several shapes: peaked, flat, integer-valued (big tie groups), with -inf."""
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.randn((4, V), generator=gen) * 3
    flat = torch.zeros((2, V))
    ties = torch.randint(0, 5, (4, V), generator=gen).to(torch.float32)
    masked = torch.randn((2, V), generator=gen)
    masked[:, ::3] = float("-inf")
    return torch.cat([peaked, flat, ties, masked])                     # (12, V)


def _kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def _assert_same_kept(got: torch.Tensor, want: torch.Tensor, what: str, params) -> None:
    got, want = _kept(got.cpu()), _kept(want)
    for row in range(want.shape[0]):
        if not torch.equal(got[row], want[row]):
            extra = torch.nonzero(got[row] & ~want[row]).flatten().tolist()[:8]
            missing = torch.nonzero(want[row] & ~got[row]).flatten().tolist()[:8]
            pytest.fail(f"{what}: row {row} ({params(row)}) kept extra {extra}, dropped {missing}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1000, 4096, 8])     # padded to column_sum's shape, and not
def test_top_k_by_bisection_matches_the_reference(device, V):
    x = _logits(V, seed=1)
    k = torch.tensor([1, 5, 50, 200, 0, 7, 1, 64, 300, 999, 3, 1000], dtype=torch.int32).clamp(max=V + 1)
    want = REF.apply_top_k(x, SimpleNamespace(top_k=k))
    got = thresholds.top_k_by_bisection(x.to(_device(device)), k.to(_device(device)))
    _assert_same_kept(got, want, "top_k_by_bisection", lambda r: f"k={int(k[r])}")


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_by_candidates_matches_the_reference(device):
    x = _logits(1000, seed=6)
    k = torch.tensor([1, 5, 50, 64, 0, 7, 1, 64, 30, 2, 3, 0], dtype=torch.int32)
    want = REF.apply_top_k(x, SimpleNamespace(top_k=k))
    got = thresholds.top_k_by_candidates(x.to(_device(device)), k.to(_device(device)), 64)
    _assert_same_kept(got, want, "top_k_by_candidates", lambda r: f"k={int(k[r])}")


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_by_bisection_matches_the_reference(device):
    x = _logits(1000, seed=2)
    p = torch.tensor([0.9, 0.5, 0.1, 1.0, 0.3, 0.95, 0.2, 0.7, 0.999, 0.05, 0.6, 0.8])
    want = REF.apply_top_p(x, SimpleNamespace(top_p=p))
    got = thresholds.top_p_by_bisection(x.to(_device(device)), p.to(_device(device)))
    _assert_same_kept(got, want, "top_p_by_bisection", lambda r: f"top_p={float(p[r])}")


def _top_p_whole_range(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13 as ``top_p_by_bisection`` was before the rough search: one exact bisection
    over the whole range of each row's probabilities, from the smallest positive one (where
    its mass holds; else from 0) to just above the largest."""
    probs = thresholds.softmax_rows(x)
    p = top_p[:, None]
    smallest = torch.where(probs > 0, probs, 1.0).min(dim=-1, keepdim=True).values
    whole = thresholds._holds_mass(smallest, probs, p)
    hi = thresholds.order_keys(probs.max(dim=-1, keepdim=True).values).to(torch.int64) + 1
    lo = torch.where(whole, thresholds.order_keys(smallest).to(torch.int64), 0)
    lo = torch.where(p >= 1.0, hi - 1, lo)
    threshold = thresholds._bisect_largest(lo, hi, thresholds.PROB_BISECTION_STEPS,
                                           thresholds._holds_mass, (probs, p), "top_p whole")
    return torch.where((probs >= threshold) | (p >= 1.0), x, thresholds.NEG_INF)


def _nucleus_rows(V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16 rows: flat (0.01 randn, 0.3 randn), peaked, integer ties, equal logits, one finite
    token, underflowed probabilities, two plateaus; and top_p values from 0.001 to above any
    float32 total (1 - 2**-24 rounds to itself, above a sum that rounds down)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn((4, V), generator=gen) * 0.01, torch.randn((3, V), generator=gen) * 0.3,
                   torch.randn((3, V), generator=gen) * 3,
                   torch.randint(-4, 4, (2, V), generator=gen).to(torch.float32), torch.zeros((4, V))])
    x[13] = float("-inf")
    x[13, 5] = 1.0
    x[14] = -200.0
    x[14, 7] = 0.0
    x[15, : V // 2] = 50.0
    p = torch.tensor([0.9, 0.5, 0.99, 1 - 2**-24, 0.9, 0.1, 0.95, 0.9, 0.999, 0.3, 0.9, 0.7,
                      0.9, 0.9, 0.5, 0.6])
    return x, p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1000, 50257, 128256, 8])
def test_the_rough_search_keeps_the_whole_range_bisections_sets(device, V):
    """The rough search only picks the bracket: the kept sets are, bit for bit, those of one
    exact bisection over each row's whole range (the same float32 mass decides both), for
    vocabularies that are and are not a multiple of the rough sum's 32 rows."""
    x, p = _nucleus_rows(V, seed=V)
    dev = _device(device)
    got = thresholds.top_p_by_bisection(x.to(dev), p.to(dev)).cpu()
    want = _top_p_whole_range(x.to(dev), p.to(dev)).cpu()
    assert torch.equal(got, want), torch.nonzero((got != want).any(-1)).flatten().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias, V", [(0.05, 997), (-0.05, 998)])
def test_a_rough_bracket_that_fails_its_check_falls_back_to_the_whole_range(device, bias, V, monkeypatch):
    """A rough mass off by 0.05 (far beyond its margin) puts one end of the rough bracket on
    the wrong side: too high, the low end fails to hold exactly; too low, the high end holds.
    The exact checks catch it, the search falls back to that side of the whole range, and the
    kept sets are still the whole-range bisection's. Each vocabulary is this test's own, so
    the loop is traced with the patched mass."""
    rough = thresholds._rough_mass
    monkeypatch.setattr(thresholds, "_rough_mass", lambda probs, t: rough(probs, t) + bias)
    x, p = _nucleus_rows(V, seed=3)
    dev = _device(device)
    got = thresholds.top_p_by_bisection(x.to(dev), p.to(dev)).cpu()
    want = _top_p_whole_range(x.to(dev), p.to(dev)).cpu()
    assert torch.equal(got, want), torch.nonzero((got != want).any(-1)).flatten().tolist()
    if device == "cpu":                                    # the fallback did happen
        probs = thresholds.softmax_rows(x)
        floor = thresholds.order_keys(torch.where(probs > 0, probs, 1.0).min(dim=-1, keepdim=True)
                                      .values).to(torch.int64) - 1
        top = thresholds.order_keys(probs.max(dim=-1, keepdim=True).values).to(torch.int64) + 1
        lo, hi = thresholds._top_p_bracket(probs, p[:, None], floor, top)
        fell_back = (lo == floor) if bias > 0 else (hi == top)
        assert fell_back[:12].any() and (hi - lo > 1)[:12].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("candidates", [64, 8])
def test_candidates_match_the_reference_min_p_top_k_top_p(device, candidates):
    """With 8 candidates the integer-valued rows tie far beyond the candidate set."""
    x = _logits(1000, seed=3)
    k = torch.tensor([50, 5, 8, 1, 8, 3, 5, 8, 2, 8, 4, 6], dtype=torch.int32).clamp(max=candidates)
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.8, 0.95, 0.2, 0.7, 1.0, 0.05, 0.6, 0.99])
    m = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.2, 0.0, 0.01, 0.0, 0.3, 0.0, 0.0, 0.1])
    s = SimpleNamespace(top_k=k, top_p=p, min_p=m)
    want = REF.apply_top_p(REF.apply_top_k(REF.apply_min_p(x, s), s), s)
    dev = _device(device)
    got = thresholds.top_k_top_p_candidates(x.to(dev), k.to(dev), p.to(dev), m.to(dev), candidates)
    _assert_same_kept(got, want, f"candidates={candidates}",
                      lambda r: f"k={int(k[r])}, top_p={float(p[r])}, min_p={float(m[r])}")
    torch.testing.assert_close(got.cpu()[_kept(want)], want[_kept(want)])


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_filter_matches_the_reference(device):
    x = _logits(1000, seed=4)
    m = torch.tensor([0.0, 0.05, 0.5, 1.0, 0.1, 0.0, 0.3, 0.01, 0.9, 0.2, 0.0, 0.4])
    want = REF.apply_min_p(x, SimpleNamespace(min_p=m))
    got = thresholds.min_p_filter(x.to(_device(device)), m.to(_device(device)))
    _assert_same_kept(got, want, "min_p_filter", lambda r: f"min_p={float(m[r])}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1000, 1031, 128])
def test_first_argmax_and_top_values_match_torch(device, V):
    """1031 is prime: the chunked reductions need a tail chunk."""
    x = _logits(V, seed=5)
    x[0, V - 1] = x[0].max() + 1                     # the maximum in the tail chunk
    x[1, 3] = x[1, V - 2] = 7.0                      # tie: the lower id wins
    dev = _device(device)
    assert torch.equal(thresholds.first_argmax(x.to(dev)).cpu(), torch.argmax(x, dim=-1))
    for k in (1, 20, 64):
        got = thresholds.top_values(x.to(dev), k).cpu()
        assert torch.equal(got, torch.topk(x, k, dim=-1).values), f"top_values k={k}, V={V}"


def test_order_keys_sort_like_the_floats():
    values = torch.tensor([float("-inf"), -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0,
                           2.0, 3e38, float("inf")])
    keys = thresholds.order_keys(values)
    assert torch.equal(torch.sort(keys).values, keys)                        # monotone
    assert keys[5] == keys[6] == 0                                           # -0.0 == +0.0
    back = thresholds.value_of_key(keys)
    assert torch.equal(back, values.abs() * torch.sign(values) + 0.0)        # -0.0 -> +0.0


@pytest.mark.parametrize("device", DEVICES)
def test_top_entries_give_topk_ids(device):
    x = _logits(1000, seed=7)[:4]                     # peaked rows: no ties
    values, ids = thresholds.top_entries(x.to(_device(device)), 20)
    want = torch.topk(x, 20, dim=-1)
    assert torch.equal(values.cpu(), want.values) and torch.equal(ids.cpu(), want.indices)


@needs_xla
def test_top_entries_on_xla_put_lower_ids_first_among_ties():
    """XLA's TopK is stable and the candidates stay in id order (CPU topk is not stable)."""
    x = (torch.arange(1000) % 10).to(torch.float32).expand(2, 1000)   # 100 tokens per value
    values, ids = thresholds.top_entries(x.to(xla_device()), 20)
    assert ids.cpu()[0].tolist() == list(range(9, 200, 10)) and (values.cpu() == 9).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bisections_resolve_neighbouring_floats(device):
    """Logits one float32 step apart: the k-th largest and the nucleus boundary are found to
    the last bit (the bisection's midpoints must be exact integers)."""
    steps = torch.arange(1000, dtype=torch.int32)
    x = (torch.tensor(1.0).view(torch.int32) + steps).view(torch.float32).repeat(2, 1)   # 1.0, 1.0 + ulp, ...
    k = torch.tensor([500, 999], dtype=torch.int32)
    want = REF.apply_top_k(x, SimpleNamespace(top_k=k))
    got = thresholds.top_k_by_bisection(x.to(_device(device)), k.to(_device(device)))
    _assert_same_kept(got, want, "top_k_by_bisection", lambda r: f"k={int(k[r])}")
    p = torch.tensor([0.5, 0.9])
    want = REF.apply_top_p(x * 1e4, SimpleNamespace(top_p=p))
    got = thresholds.top_p_by_bisection((x * 1e4).to(_device(device)), p.to(_device(device)))
    _assert_same_kept(got, want, "top_p_by_bisection", lambda r: f"top_p={float(p[r])}")


@needs_xla
def test_why_bisection_midpoints_shift_instead_of_dividing():
    """torch-xla 2.9 computes ``int64 // 2`` through float32 (2**30 + 1 loses its last bits),
    which would stop a bisection short; ``thresholds`` shifts instead. If this starts failing,
    torch-xla divides exactly (nothing to change)."""
    x = torch.tensor([2**30 + 1, 2**31 + 5], dtype=torch.int64)
    on_xla = (x.to(xla_device()) // 2).cpu()
    if torch.equal(on_xla, x // 2):
        pytest.xfail("torch-xla now divides int64 exactly")
    assert torch.equal(torch.bitwise_right_shift(x.to(xla_device()), 1).cpu(), x // 2)


@needs_xla
def test_a_bisection_is_one_loop_in_the_graph():
    """Each search compiles its pass once, inside an XLA ``While`` (``xla.fori_loop``), instead
    of 32 copies of it: the graph of ``top_k_by_bisection`` holds one loop and fewer compares
    than passes. Unrolled, the three bisections of a random step made most of its compile time
    (docs/tpu.md)."""
    import torch_xla
    x = _logits(1000).to(xla_device())
    kept = thresholds.top_k_by_bisection(x, torch.full((12,), 7, dtype=torch.int32).to(xla_device()))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([kept])
    assert hlo.count(" while(") == 1, hlo[:2000]
    assert hlo.count(" compare(") < thresholds.KEY_BISECTION_STEPS


@needs_xla
def test_a_loop_body_that_changes_the_carry_is_refused():
    from corelib_tpu import xla
    lo = torch.zeros((2, 1), dtype=torch.int64).to(xla_device())
    with pytest.raises(ValueError, match=r"fori_loop 'widen': the body returns"):
        xla.fori_loop(3, lambda lo: (lo.to(torch.float32),), (lo,), (), "widen")


def test_fori_loop_off_xla_runs_the_body_eagerly():
    from corelib_tpu import xla
    total, step = xla.fori_loop(5, lambda t, s, inc: (t + s * inc, s + 1),
                                (torch.tensor(0), torch.tensor(1)), (torch.tensor(2),), "sum")
    assert int(total) == 2 * (1 + 2 + 3 + 4 + 5) and int(step) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_fori_loop_stops_when_its_live_flag_turns_false(device):
    """A loop with ``live`` runs while the flag holds (here: until the count reaches 3 of at
    most 10 steps), on the device as one ``While`` whose condition reads it."""
    from corelib_tpu import xla
    dev = _device(device)

    def body(count, more, limit):
        count = count + 1
        return count, count < limit

    count, more = xla.fori_loop(10, body, (torch.zeros((), dtype=torch.int32).to(dev),
                                           torch.ones((), dtype=torch.bool).to(dev)),
                                (torch.tensor(3, dtype=torch.int32).to(dev),), "live test", live=1)
    assert int(count.cpu()) == 3 and not bool(more.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_the_draw_over_candidates_picks_the_vocabulary_draws_token(device):
    """``TpuSampler.draw``'s two races agree wherever the narrow one may run: rows keeping at
    most K tokens (ties at the boundary, tied maxima, one token) and greedy rows, over many
    noise keys; ``narrow_rows`` says which rows those are."""
    from corelib_tpu.sampler import _draw_over_candidates, _draw_over_vocabulary
    V, K = 1000, 64
    gen = torch.Generator().manual_seed(7)
    x = _logits(V)
    k = torch.tensor([1, 5, 64, 50, 1, 64, 3, 64, 20, 2, 64, 7], dtype=torch.int32)
    kept = thresholds.top_k_by_bisection(x, k)            # ties at the k-th kept: may exceed k
    greedy = torch.zeros(12, dtype=torch.bool)
    greedy[[4, 6, 7, 11]] = True          # a flat row and tied rows: the lowest id of the maxima
    kept = torch.where(greedy[:, None], x, kept)
    dev = _device(device)
    narrow = thresholds.narrow_rows(kept.to(dev), K, greedy.to(dev)).cpu()
    expected = greedy | (torch.isfinite(kept).sum(dim=-1) <= K)
    assert torch.equal(narrow, expected) and int(narrow.sum()) >= 8, narrow
    rows = narrow.nonzero()[:, 0]
    x_dev, greedy_dev = kept[rows].to(dev), greedy[rows].to(dev)
    for trial in range(20):
        keys = torch.randint(-(2**31), 2**31, (len(rows),), dtype=torch.int32, generator=gen).to(dev)
        wide = _draw_over_vocabulary(x_dev, keys, greedy_dev).cpu()
        narrow_ids = _draw_over_candidates(K)(x_dev, keys, greedy_dev).cpu()
        assert torch.equal(wide, narrow_ids), f"trial {trial}: {wide} vs {narrow_ids}"


@pytest.mark.parametrize("device", DEVICES)
def test_narrow_rows_refuse_nan_and_inf(device):
    x = torch.full((3, 100), float("-inf"))
    x[:, :3] = 1.0
    x[1, 50] = float("nan")
    x[2, 60] = float("inf")
    greedy = torch.tensor([False, True, True])
    assert thresholds.narrow_rows(x.to(_device(device)), 64, greedy.to(_device(device))).cpu().tolist() == \
        [True, False, False]
