"""corelib's samplers against llama.cpp's, through llama-cpp-python's low-level bindings.

Each llama.cpp sampler runs on a candidate array built here from the same float32 logits (no
model is loaded): ``llama_sampler_apply`` either shrinks the array (top-k, top-p, min-p,
typical, XTC, mirostat) or writes -inf into it (top-n-sigma), so its kept set is the finite
entries of ``data[:size]`` after the call. Where the contract chose differently from
llama.cpp, the test says so and checks the difference (or builds inputs where the choices
agree and says why). llama.cpp's own choices that matter here:

- ``min_keep``: most llama.cpp filters take one; the contract has none (a filter never drops
  the most likely token, and otherwise keeps what its rule keeps), so ``min_keep = 1`` is
  the contract's rule and larger values are llama.cpp's alone.
- Ties: llama.cpp's top-k, top-p, XTC and mirostat cut a sorted array at a position, so of
  tokens tied at the boundary some go and some stay, by sort order; the contract keeps (or,
  for XTC, drops) the whole tie. The random rows have no ties; one test shows the top-k case.

Skipped when llama-cpp-python is not installed (``pip install -e .[oracle]``, or
``ensure_llama_cpp`` in scripts/lib.sh).
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (the `oracle` extra)")

from corelib import SamplingParams  # noqa: E402
from oracle_rows import (  # noqa: E402
    REF, ROW_IDS, assert_kept_equal, corelib_final, corelib_kept, cumulative_edge, logit_row, near)

SEED = 1234


class Candidates:
    """A ``llama_token_data_array`` over the tokens ``ids`` of a ``[V]`` float32 row.

    llama.cpp's samplers reorder, shrink, shift (XTC moves ``data``) or rewrite it in place;
    the buffer stays owned by this object."""

    def __init__(self, logits: torch.Tensor, ids=None):
        values = logits.tolist()
        ids = range(len(values)) if ids is None else list(ids)
        self.buffer = (llama_cpp.llama_token_data * len(ids))(
            *(llama_cpp.llama_token_data(i, values[i], 0.0) for i in ids))
        self.array = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self.buffer, llama_cpp.llama_token_data_p),
            size=len(ids), selected=-1, sorted=False)

    def apply(self, sampler) -> "Candidates":
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(self.array))
        return self

    def entries(self) -> list:
        return [self.array.data[i] for i in range(self.array.size)]

    def kept(self) -> set[int]:
        return {e.id for e in self.entries() if math.isfinite(e.logit)}

    def logits(self) -> dict[int, float]:
        return {e.id: e.logit for e in self.entries()}

    def selected(self) -> int:
        assert self.array.selected >= 0, "the sampler selected no token"
        return self.array.data[self.array.selected].id


def oracle(init, *args):
    """A fresh llama.cpp sampler; freed when the test ends (see the fixture below)."""
    sampler = init(*args)
    assert sampler, f"{init.__name__}{args} returned NULL"
    _made.append(sampler)
    return sampler


_made: list = []


@pytest.fixture(autouse=True)
def free_samplers():
    yield
    while _made:
        llama_cpp.llama_sampler_free(_made.pop())


def llama_kept(logits: torch.Tensor, init, *args) -> set[int]:
    return Candidates(logits).apply(oracle(init, *args)).kept()


def probs64(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), -1)


# ---------------------------------------------------------------------- sanity baseline
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.5])
@pytest.mark.parametrize("row_id", ROW_IDS[::3])
def test_temperature_divides_the_logits_as_llama_cpp(row_id, temperature):
    logits = logit_row(row_id)
    sampler = oracle(llama_cpp.llama_sampler_init_temp, temperature)
    theirs = Candidates(logits).apply(sampler).logits()
    ours = corelib_final(logits, temperature=temperature)
    expected = torch.tensor([theirs[i] for i in range(len(logits))])
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 5, 40])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_top_k_matches_llama_cpp(row_id, top_k):
    logits = logit_row(row_id)
    assert corelib_kept(logits, top_k=top_k) == llama_kept(
        logits, llama_cpp.llama_sampler_init_top_k, top_k)


def test_top_k_ties_at_the_boundary_are_kept_by_the_contract_only():
    """The contract keeps every token tied with the k-th largest logit; llama.cpp keeps
    exactly k, the tie broken by its sort."""
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    ours = corelib_kept(logits, top_k=2)
    theirs = llama_kept(logits, llama_cpp.llama_sampler_init_top_k, 2)
    assert ours == {0, 1, 2, 3}
    assert len(theirs) == 2 and 0 in theirs and theirs < ours


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_top_p_matches_llama_cpp(row_id, top_p):
    logits = logit_row(row_id)
    p = probs64(logits)
    edge = cumulative_edge(p, torch.argsort(p, descending=True), top_p)
    assert_kept_equal(corelib_kept(logits, top_p=top_p),
                      llama_kept(logits, llama_cpp.llama_sampler_init_top_p, top_p, 1), edge)


# ---------------------------------------------------------------------- min-p
@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.2, 0.6])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_min_p_matches_llama_cpp(row_id, min_p):
    """llama.cpp compares logits with max + ln(min_p), the contract probabilities with
    min_p * max p: the same rule, up to rounding at the threshold."""
    logits = logit_row(row_id)
    p = probs64(logits)
    edge = near(p, min_p * float(p.max()))
    assert_kept_equal(corelib_kept(logits, min_p=min_p),
                      llama_kept(logits, llama_cpp.llama_sampler_init_min_p, min_p, 1), edge)


def test_min_p_min_keep_is_llama_cpps_only():
    logits = logit_row("spiked-V1000-s0")
    ours = corelib_kept(logits, min_p=0.6)
    theirs = llama_kept(logits, llama_cpp.llama_sampler_init_min_p, 0.6, 10)
    assert len(ours) < 10 and len(theirs) == 10
    assert ours < theirs == set(torch.topk(logits, 10).indices.tolist())


# ---------------------------------------------------------------------- typical-p
@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.95])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_typical_p_matches_llama_cpp(row_id, typical_p):
    """llama.cpp stops once the running mass is > typical_p, the contract once it is
    >= typical_p: they differ only when the mass lands on typical_p exactly, an edge case."""
    logits = logit_row(row_id)
    logp = torch.log_softmax(logits.double(), -1)
    entropy = -(logp.exp() * logp).sum()
    edge = cumulative_edge(logp.exp(), torch.argsort((-logp - entropy).abs()), typical_p)
    assert_kept_equal(corelib_kept(logits, typical_p=typical_p),
                      llama_kept(logits, llama_cpp.llama_sampler_init_typical, typical_p, 1), edge)


# ---------------------------------------------------------------------- top-n-sigma
def sigma_threshold(logits: torch.Tensor, n: float) -> float:
    finite = logits[torch.isfinite(logits)].double()
    return float(finite.max() - n * finite.std(unbiased=False))


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_top_n_sigma_matches_llama_cpp(row_id, n):
    logits = logit_row(row_id)
    edge = near(logits, sigma_threshold(logits, n))
    assert_kept_equal(corelib_kept(logits, top_n_sigma=n),
                      llama_kept(logits, llama_cpp.llama_sampler_init_top_n_sigma, n), edge)


@pytest.mark.parametrize("row_id", ["flat-V50-s0", "peaked-V1000-s1"])
def test_top_n_sigma_ignores_dropped_tokens_like_llama_cpp(row_id):
    """Both take max and sigma over the finite logits only: tokens dropped earlier (here by
    allowed_token_ids, -inf in llama.cpp's array) do not widen sigma."""
    logits = logit_row(row_id)
    allowed = list(range(0, len(logits), 3))
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    edge = near(masked, sigma_threshold(masked, 1.0))
    ours = corelib_kept(logits, top_n_sigma=1.0, allowed_token_ids=allowed)
    theirs = Candidates(masked).apply(oracle(llama_cpp.llama_sampler_init_top_n_sigma, 1.0)).kept()
    assert_kept_equal(ours, theirs, edge)
    assert ours < set(allowed)


# ---------------------------------------------------------------------- XTC
@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.1, 0.3])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_xtc_matches_llama_cpp_when_it_acts(row_id, threshold):
    """xtc_probability = 1 on both sides: llama.cpp's coin is its own generator's (seeded
    here), the contract's is its noise stream; at probability 1 both always act, so the kept
    sets compare directly. min_keep = 1 is the contract's rule (XTC never empties a row)."""
    logits = logit_row(row_id)
    edge = near(probs64(logits), threshold) if threshold > 0 else set()
    ours = corelib_kept(logits, xtc_probability=1.0, xtc_threshold=threshold, seed=SEED)
    theirs = llama_kept(logits, llama_cpp.llama_sampler_init_xtc, 1.0, threshold, 1, SEED)
    assert_kept_equal(ours, theirs, edge)


def test_xtc_probability_zero_never_acts_on_either_side():
    logits = logit_row("spiked-V50-s0")
    assert corelib_kept(logits, xtc_probability=0.0, xtc_threshold=0.01) == set(range(50))
    theirs = llama_kept(logits, llama_cpp.llama_sampler_init_xtc, 0.0, 0.01, 1, SEED)
    assert theirs == set(range(50))


def test_xtc_ties_at_the_smallest_probability_above_threshold_are_kept_by_the_contract_only():
    """Tokens 1 and 2 tie at the smallest probability above the threshold. The contract drops
    every token above it except those with that smallest probability (both stay); llama.cpp
    cuts its sorted array after the last one above the threshold and keeps one of the tie."""
    logits = torch.tensor([3.0, 2.0, 2.0, -2.0, -3.0])
    ours = corelib_kept(logits, xtc_probability=1.0, xtc_threshold=0.05, seed=SEED)
    theirs = llama_kept(logits, llama_cpp.llama_sampler_init_xtc, 1.0, 0.05, 1, SEED)
    assert ours == {1, 2, 3, 4}
    assert len(theirs) == 3 and {3, 4} < theirs and theirs < ours


# ---------------------------------------------------------------------- dynamic temperature
def dynamic_temperature(logits: torch.Tensor, t: float, d: float, exponent: float, n: int) -> float:
    """The contract's T' (float64) with Hmax = ln n."""
    p = probs64(logits)
    p = p[p > 0]
    h = float(-(p * p.log()).sum())
    lo, hi = max(0.0, t - d), t + d
    return lo + (hi - lo) * (h / math.log(n)) ** exponent


@pytest.mark.parametrize("t, d, exponent", [(1.0, 0.5, 1.0), (0.7, 0.7, 2.0), (1.2, 0.3, 0.5),
                                            (0.5, 1.0, 1.0)])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_dynamic_temperature_matches_llama_cpp(row_id, t, d, exponent):
    """llama_sampler_init_temp_ext(T, d, exponent): T' from the normalised entropy, then
    logits / T'. Every token is kept here, so llama.cpp's n (its array's size) is the
    contract's n (the kept tokens)."""
    logits = logit_row(row_id)
    theirs = Candidates(logits).apply(
        oracle(llama_cpp.llama_sampler_init_temp_ext, t, d, exponent)).logits()
    ours = corelib_final(logits, temperature=t, dynatemp_range=d, dynatemp_exponent=exponent)
    expected = torch.tensor([theirs[i] for i in range(len(logits))])
    torch.testing.assert_close(ours, expected, rtol=2e-5, atol=2e-5)
    t_dyn = dynamic_temperature(logits, t, d, exponent, len(logits))
    torch.testing.assert_close(ours, logits / t_dyn, rtol=2e-5, atol=2e-5)


def test_dynamic_temperature_counts_kept_tokens_where_llama_cpp_counts_its_array():
    """The contract's Hmax is ln(number of kept tokens); llama.cpp's is ln(its array's size),
    which counts entries an earlier sampler set to -inf. On an array that holds only the
    kept tokens the two agree; on one that also holds dropped tokens as -inf they do not."""
    logits = logit_row("peaked-V50-s0")
    allowed = [3, 7, 11, 19, 42]
    params = dict(temperature=1.0, dynatemp_range=0.6, dynatemp_exponent=1.0)
    ours = corelib_final(logits, allowed_token_ids=allowed, **params)
    assert corelib_kept(logits, allowed_token_ids=allowed, **params) == set(allowed)
    init = (llama_cpp.llama_sampler_init_temp_ext, 1.0, 0.6, 1.0)
    compact = Candidates(logits, ids=allowed).apply(oracle(*init)).logits()
    torch.testing.assert_close(ours[allowed], torch.tensor([compact[i] for i in allowed]),
                               rtol=2e-5, atol=2e-5)
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    padded = Candidates(masked).apply(oracle(*init)).logits()
    t_padded = dynamic_temperature(masked, 1.0, 0.6, 1.0, len(logits))
    t_kept = dynamic_temperature(masked, 1.0, 0.6, 1.0, len(allowed))
    assert abs(t_padded - t_kept) > 0.05
    torch.testing.assert_close(torch.tensor([padded[i] for i in allowed]),
                               logits[allowed] / t_padded, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ours[allowed], logits[allowed] / t_kept, rtol=2e-5, atol=2e-5)


def test_dynamic_temperature_leaves_a_single_kept_token_as_it_is_like_llama_cpp():
    """n <= 1: both leave the logit untouched, not even divided by T."""
    logits = logit_row("flat-V50-s1")
    ours = corelib_final(logits, allowed_token_ids=[9], temperature=0.5, dynatemp_range=0.3)
    theirs = Candidates(logits, ids=[9]).apply(
        oracle(llama_cpp.llama_sampler_init_temp_ext, 0.5, 0.3, 1.0)).logits()
    assert corelib_kept(logits, allowed_token_ids=[9], temperature=0.5, dynatemp_range=0.3) == {9}
    assert float(ours[9]) == theirs[9] == float(logits[9])


# ---------------------------------------------------------------------- mirostat v2
class MirostatV2Ctx(ctypes.Structure):
    """The head of llama.cpp's ``llama_sampler_mirostat_v2`` context (llama-sampler.cpp of
    the pinned release): it keeps mu internally and exposes no getter, so the test reads it
    from the context, after checking tau and eta read back as given."""
    _fields_ = [("seed", ctypes.c_uint32), ("seed_cur", ctypes.c_uint32),
                ("tau", ctypes.c_float), ("eta", ctypes.c_float), ("mu", ctypes.c_float)]


class SamplerHead(ctypes.Structure):
    """``struct llama_sampler``: its interface and its context pointers."""
    _fields_ = [("iface", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def mirostat_ctx(sampler) -> MirostatV2Ctx:
    head = ctypes.cast(sampler, ctypes.POINTER(SamplerHead)).contents
    return MirostatV2Ctx.from_address(head.ctx)


def mirostat_edge(logits: torch.Tensor, mu: float) -> set[int]:
    return near(-probs64(logits).log2(), mu)


@pytest.mark.parametrize("tau, eta", [(3.0, 0.1), (5.0, 0.3), (1.5, 1.0)])
@pytest.mark.parametrize("vocab", [50, 1000])
def test_mirostat_v2_follows_llama_cpp_step_by_step(vocab, tau, eta):
    """Twelve steps over different rows. llama.cpp truncates, draws with its own generator
    and updates mu from the token it drew; that token is appended to corelib's row, whose mu
    (its sampler_state) and kept set must match llama.cpp's at every step. The contract's
    update for a token it kept is llama.cpp's (p' from the renormalised kept set)."""
    sampler = oracle(llama_cpp.llama_sampler_init_mirostat_v2, SEED, tau, eta)
    ctx = mirostat_ctx(sampler)
    assert (ctx.tau, ctx.eta, ctx.mu) == pytest.approx((tau, eta, 2 * tau), rel=1e-6)
    batch = REF.new_batch(vocab_size=vocab)
    batch.add("r", SamplingParams(mirostat_tau=tau, mirostat_eta=eta, seed=SEED))
    assert batch.sampler_state("r") == [[pytest.approx(2 * tau)]]
    rows = [row for row in ROW_IDS if row.endswith(f"V{vocab}-s0") or row.endswith(f"V{vocab}-s1")]
    truncated = False
    for step in range(12):
        logits = logit_row(rows[step % len(rows)])
        edge = mirostat_edge(logits, ctx.mu)
        ours = set(torch.isfinite(REF.processed_logits(logits[None], batch)[0]).nonzero()
                   .flatten().tolist())
        candidates = Candidates(logits).apply(sampler)
        assert_kept_equal(ours, candidates.kept(), edge)
        truncated |= 1 < len(ours) < vocab
        token = candidates.selected()
        REF.sample(logits[None], batch)   # append advances the state from the step's sample
        batch.append([token])
        (mu,), = batch.sampler_state("r")
        assert mu == pytest.approx(ctx.mu, rel=1e-4, abs=1e-4), step
    assert truncated, "mu never cut a row below its full size but above one token: a weak test"


def test_mirostat_v2_after_min_p_matches_llama_cpp():
    """A chain min-p -> mirostat v2: both truncate the renormalised min-p set."""
    vocab, tau, eta = 1000, 4.0, 0.2
    min_p = oracle(llama_cpp.llama_sampler_init_min_p, 0.02, 1)
    sampler = oracle(llama_cpp.llama_sampler_init_mirostat_v2, SEED, tau, eta)
    ctx = mirostat_ctx(sampler)
    batch = REF.new_batch(vocab_size=vocab)
    batch.add("r", SamplingParams(min_p=0.02, mirostat_tau=tau, mirostat_eta=eta))
    for step in range(8):
        logits = logit_row(ROW_IDS[6 + step % 6])
        ours = set(torch.isfinite(REF.processed_logits(logits[None], batch)[0]).nonzero()
                   .flatten().tolist())
        candidates = Candidates(logits).apply(min_p).apply(sampler)
        kept_min_p = corelib_kept(logits, min_p=0.02)
        renormalised = torch.full_like(logits, float("-inf"))
        renormalised[list(kept_min_p)] = logits[list(kept_min_p)]
        assert_kept_equal(ours, candidates.kept(), mirostat_edge(renormalised, ctx.mu))
        REF.sample(logits[None], batch)
        batch.append([candidates.selected()])
        (mu,), = batch.sampler_state("r")
        assert mu == pytest.approx(ctx.mu, rel=1e-4, abs=1e-4), step


# ---------------------------------------------------------------------- adaptive-p
@pytest.mark.parametrize("target, decay", [(0.5, 0.9), (0.1, 0.5), (0.9, 0.99), (0.3, 0.0)])
@pytest.mark.parametrize("vocab", [50, 1000])
def test_adaptive_p_follows_llama_cpp_step_by_step(vocab, target, decay):
    """Ten steps: llama.cpp transforms and draws; its token is accepted there and appended
    here. The transformed distribution (log-softmax of both sides' logits) depends on the
    state (w, s) through the adapted target, so matching it at every step follows the state
    recurrence; the state itself is checked against the contract's update."""
    sampler = oracle(llama_cpp.llama_sampler_init_adaptive_p, target, decay, SEED)
    batch = REF.new_batch(vocab_size=vocab)
    batch.add("r", SamplingParams(adaptive_p_target=target, adaptive_p_decay=decay, seed=SEED))
    w, s = target / (1 - decay), 1 / (1 - decay)
    rows = [row for row in ROW_IDS if f"-V{vocab}-" in row]
    for step in range(10):
        logits = logit_row(rows[step % len(rows)])
        ours = torch.log_softmax(REF.processed_logits(logits[None], batch)[0].double(), -1)
        candidates = Candidates(logits).apply(sampler)
        theirs = candidates.logits()
        theirs = torch.log_softmax(torch.tensor([theirs[i] for i in range(vocab)]).double(), -1)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        token = candidates.selected()
        llama_cpp.llama_sampler_accept(sampler, token)
        REF.sample(logits[None], batch)   # append advances the state from the step's sample
        batch.append([token])
        w, s = float(probs64(logits)[token]) + decay * w, 1 + decay * s
        (got_w, got_s), = batch.sampler_state("r")
        assert (got_w, got_s) == pytest.approx((w, s), rel=1e-5), step


# ---------------------------------------------------------------------- order of the group
L = llama_cpp
ORDERS = {
    # llama.cpp's own default chain order (its samplers that the contract has, in order)
    "llama-default": (["top_k", "typical_p", "top_p", "min_p", "xtc", "temperature"],
                      [(L.llama_sampler_init_top_k, 40), (L.llama_sampler_init_typical, 0.95, 1),
                       (L.llama_sampler_init_top_p, 0.9, 1), (L.llama_sampler_init_min_p, 0.05, 1),
                       (L.llama_sampler_init_xtc, 1.0, 0.1, 1, SEED),
                       (L.llama_sampler_init_temp_ext, 0.8, 0.4, 1.0)]),
    "sigma-after-min-p": (["min_p", "top_n_sigma", "temperature"],
                          [(L.llama_sampler_init_min_p, 0.02, 1),
                           (L.llama_sampler_init_top_n_sigma, 1.0),
                           (L.llama_sampler_init_temp, 0.7)]),
    "temperature-first": (["temperature", "min_p", "top_p"],
                          [(L.llama_sampler_init_temp_ext, 1.3, 0.5, 2.0),
                           (L.llama_sampler_init_min_p, 0.05, 1),
                           (L.llama_sampler_init_top_p, 0.8, 1)]),
}
ORDER_PARAMS = {
    "llama-default": dict(top_k=40, typical_p=0.95, top_p=0.9, min_p=0.05, xtc_probability=1.0,
                          xtc_threshold=0.1, temperature=0.8, dynatemp_range=0.4),
    "sigma-after-min-p": dict(min_p=0.02, top_n_sigma=1.0, temperature=0.7),
    "temperature-first": dict(temperature=1.3, dynatemp_range=0.5, dynatemp_exponent=2.0,
                              min_p=0.05, top_p=0.8),
}


def chain(logits: torch.Tensor, samplers) -> dict[int, float]:
    """llama.cpp's chain of ``samplers`` on one array (a chain applies each in turn); the
    finite logits left, by token id."""
    candidates = Candidates(logits)
    for init, *args in samplers:
        candidates.apply(oracle(init, *args))
    return {i: v for i, v in candidates.logits().items() if math.isfinite(v)}


def assert_same_final(ours: torch.Tensor, theirs: dict[int, float]) -> None:
    assert set(torch.isfinite(ours).nonzero().flatten().tolist()) == set(theirs)
    ids = sorted(theirs)
    torch.testing.assert_close(ours[ids], torch.tensor([theirs[i] for i in ids]),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_sampler_order_matches_a_llama_cpp_chain_in_that_order(row_id, order):
    """The row runs exactly the listed filters in the listed order, as a llama.cpp chain
    does: the kept set and the final logits agree. Exact on these fixed rows: a token flipped
    at some stage's threshold by rounding would show here as a failure to look at, not be
    allowed. Every stage shrinks llama.cpp's array here, so dynamic temperature's n (the
    array's size there) is the number of kept tokens, as in the contract."""
    names, samplers = ORDERS[order]
    logits = logit_row(row_id)
    ours = corelib_final(logits, sampler_order=names, seed=SEED, **ORDER_PARAMS[order])
    assert_same_final(ours, chain(logits, samplers))


@pytest.mark.parametrize("row_id", ROW_IDS[::2])
def test_temperature_last_matches_a_llama_cpp_chain_with_temperature_last(row_id):
    """temperature_last: min-p and top-p see the untempered distribution; both the kept set
    and the tempered logits match llama.cpp's chain min-p -> top-p -> temp. The same
    request without it matches temp -> min-p -> top-p, and the two differ on these rows."""
    logits = logit_row(row_id)
    params = dict(temperature=0.5, min_p=0.1, top_p=0.9)
    last = corelib_final(logits, temperature_last=True, **params)
    assert_same_final(last, chain(logits, [(L.llama_sampler_init_min_p, 0.1, 1),
                                           (L.llama_sampler_init_top_p, 0.9, 1),
                                           (L.llama_sampler_init_temp, 0.5)]))
    first = corelib_final(logits, **params)
    assert_same_final(first, chain(logits, [(L.llama_sampler_init_temp, 0.5),
                                            (L.llama_sampler_init_min_p, 0.1, 1),
                                            (L.llama_sampler_init_top_p, 0.9, 1)]))


def test_temperature_last_changes_the_kept_set_on_some_row():
    """Guards the test above against rows where the order cannot matter."""
    params = dict(temperature=0.5, min_p=0.1, top_p=0.9)
    changed = [row for row in ROW_IDS[::2] if corelib_kept(logit_row(row), **params)
               != corelib_kept(logit_row(row), temperature_last=True, **params)]
    assert changed


# ---------------------------------------------------------------------- selectors: differences
def test_mirostat_keeps_every_token_tied_at_the_maximum_where_llama_cpp_keeps_one():
    """Four equal logits are 2 bits each; with mu = 2 * tau = 1 every token is over mu. The
    contract never drops the most likely token and keeps all tied at the maximum; llama.cpp
    truncates its sorted array to nothing and then keeps its first entry."""
    logits = torch.zeros(4)
    batch = REF.new_batch(vocab_size=4)
    batch.add("r", SamplingParams(mirostat_tau=0.5, mirostat_eta=0.1))
    ours = torch.isfinite(REF.processed_logits(logits[None], batch)[0])
    theirs = Candidates(logits).apply(oracle(L.llama_sampler_init_mirostat_v2, SEED, 0.5, 0.1))
    assert ours.all()
    assert len(theirs.kept()) == 1


def test_adaptive_p_advances_on_any_appended_token_where_llama_cpp_only_on_its_own_draw():
    """llama.cpp's accept updates the state only for the token its last apply drew; the
    contract advances on any appended token (teacher forcing included), with p_t from the
    step's distribution. After appending a token llama.cpp did not draw, llama.cpp's next
    step equals a fresh sampler's, corelib's equals the contract's update."""
    target, decay, vocab = 0.4, 0.8, 50
    logits = logit_row("peaked-V50-s0")
    sampler = oracle(L.llama_sampler_init_adaptive_p, target, decay, SEED)
    drawn = Candidates(logits).apply(sampler).selected()
    forced = next(t for t in torch.argsort(logits, descending=True).tolist() if t != drawn)
    L.llama_sampler_accept(sampler, forced)
    nxt = logit_row("spiked-V50-s1")
    after = Candidates(nxt).apply(sampler).logits()
    fresh_sampler = oracle(L.llama_sampler_init_adaptive_p, target, decay, SEED)
    fresh = Candidates(nxt).apply(fresh_sampler).logits()
    assert after == fresh

    batch = REF.new_batch(vocab_size=vocab)
    batch.add("r", SamplingParams(adaptive_p_target=target, adaptive_p_decay=decay, seed=SEED))
    REF.sample(logits[None], batch)
    batch.append([forced])
    w = float(probs64(logits)[forced]) + decay * target / (1 - decay)
    s = 1 + decay / (1 - decay)
    assert batch.sampler_state("r") == [[pytest.approx(w, rel=1e-5), pytest.approx(s, rel=1e-5)]]
    ours = torch.log_softmax(REF.processed_logits(nxt[None], batch)[0].double(), -1)
    theirs = torch.log_softmax(torch.tensor([fresh[i] for i in range(vocab)]).double(), -1)
    assert not torch.allclose(ours, theirs, atol=1e-3)
