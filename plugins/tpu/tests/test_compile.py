"""Compile discipline, measured with torch-xla's own counter of compiled graphs.

Two module-scoped strict samplers (vocabulary 300, the example plugin's two custom stages traced
in every graph) are warmed once each: one with buckets 8 and 16 for ``sample``, one with bucket
8 and verification with K = 2; the tests then drive them through everything that varies in
serving and require that nothing compiles. (Two samplers rather than one keep the graphs a test
needs at a time within the suite's compilation cache, see ``conftest.py``; the tests of the
first run before the second is warmed.)
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corelib import SamplingParams
from corelib.bitmask import pack_bitmask
from corelib.sampler import Sampler

from corelib_tpu.filter_stages import GROUP_CONDITIONAL_MIN_ROWS
from corelib_tpu.layout import PATHS, Variant
from corelib_tpu.transfer import pack as _pack, pack_verify as _pack_verify
from corelib_tpu.sampler import RecompilationError, TpuSampler

from tpu_support import compile_count, needs_xla, xla_device

pytestmark = needs_xla

V = 300            # a vocabulary no other test module uses: every graph here is compiled here
BUCKETS = (8, 16)
K = 2
DRY_WINDOW = 32
STAGES = ("ban-repeats", "floor-prob")      # tests/plugins/corelib-stage-example

#: Parameters that send a batch down each static path.
PATH_PARAMS = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.7),
    "min_p": dict(temperature=0.7, min_p=0.05),
    "candidates": dict(top_k=20, top_p=0.9),
    "nucleus": dict(top_p=0.8),
    "exhaustive": dict(top_k=100, top_p=0.8),
}
#: Parameters that switch on the filters 10a-13b (one of them is enough).
FILTERS = dict(top_n_sigma=2.0, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.05)


def _logits(rows: int, seed: int, dtype=torch.float32, slots: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, slots, V) if slots else (rows, V)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(xla_device())


def _sampler(buckets=BUCKETS, speculative_k=(K,), **kwargs) -> TpuSampler:
    return TpuSampler(xla_device(), buckets=buckets, speculative_k=speculative_k, dry_window=DRY_WINDOW,
                      stages=STAGES, **kwargs)


@pytest.fixture(scope="module")
def warm():
    """The ``sample`` sampler: (sampler, compile counts of the first and second call of each
    (path, logprobs, filters) in the order run, report)."""
    sampler = _sampler(speculative_k=(), strict=True)
    calls = []
    for path, params in PATH_PARAMS.items():
        for logprobs in (None, 3):
            for filters in ((False, True) if path != "greedy" else (False,)):
                batch = sampler.new_batch(V)
                extra = FILTERS if filters else {}
                for i in range(8):        # full bucket: the logits need no padding graph
                    batch.add(f"r{i}", SamplingParams(**params, **extra, logprobs=logprobs, seed=i))
                assert batch.path() == path
                expected = (Variant(False, logprobs is not None, STAGES) if path == "greedy"
                            else Variant(True, True, STAGES, folded=True))
                assert batch.variant() == expected
                before = compile_count()
                sampler.sample(_logits(8, 0), batch)
                first = compile_count() - before
                sampler.sample(_logits(8, 1), batch)
                calls.append(((path, logprobs, filters), batch.variant(), first,
                              compile_count() - before - first))
    report = sampler.warmup(V, logits_dtypes=(torch.float32, torch.bfloat16), per_request_logits=True,
                            device_bitmask=True)
    return sampler, calls, report


@pytest.fixture(scope="module")
def warm_verify():
    """The ``verify`` sampler (bucket 8, K = 2), warmed with every input layout."""
    sampler = _sampler(buckets=(8,), strict=True)
    report = sampler.warmup(V, unpadded_verify=True, device_bitmask=True, block_verify=True)
    return sampler, report


def test_one_graph_per_bucket_and_variant_holds_every_path_and_filter(warm):
    """Three step graphs per bucket (greedy with logprobs or not, and the folded random one):
    each path of steps 11-13, each filter and step 15 run in the random graph's conditionals,
    compiled with it."""
    _, calls, _ = warm
    assert len(calls) == 1 + 5 * 2 * 2 + 1      # greedy: logprobs on/off; others x filters on/off
    seen = set()
    for what, variant, first, second in calls:
        expected = 0 if variant in seen else 1
        seen.add(variant)
        assert (first, second) == (expected, 0), \
            f"{what} ({variant}): {first} graph(s) on the first call, {second} on the second"
    assert len(seen) == 3


def test_warmup_compiles_the_rest(warm):
    sampler, _, report = warm
    assert report.buckets == BUCKETS and report.paths == PATHS and report.speculative_k == ()
    assert report.variants == 4
    # bucket 16's 4 step graphs (the fourth: random rows with a stateful selector, which no
    # call above used, so bucket 8's too) and the append graphs at least
    assert report.graphs >= 4 + 1 + 2
    assert report.step_graphs[("sample", 8)] == 1 and report.step_graphs[("sample", 16)] == 4
    assert sampler.guard.armed


def _random_params(rng: random.Random) -> dict:
    params = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), seed=rng.choice([None, rng.randrange(2**40)]))
    if params["temperature"] > 0:
        params.update(rng.choice([{}, dict(top_k=rng.randrange(1, 65)), dict(top_p=rng.uniform(0.1, 1.0)),
                                  dict(top_k=rng.randrange(1, 40), top_p=0.9), dict(top_k=200),
                                  dict(min_p=0.1), dict(n=2), dict(top_n_sigma=1.5),
                                  dict(typical_p=rng.uniform(0.3, 0.99)),
                                  dict(xtc_probability=0.7, xtc_threshold=0.02)]))
    params.update(rng.choice([{}, dict(logprobs=rng.randrange(0, 21)), dict(repetition_penalty=1.2),
                              dict(logit_bias={5: 3.0}), dict(allowed_token_ids=[3, 4, 5, 6]),
                              dict(bad_words=[[7, 8], [9]]), dict(min_tokens=2, stop_token_ids=[2]),
                              dict(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=[4]),
                              dict(stage_args={"ban-repeats": {"times": 1}}),
                              dict(stage_args={"floor-prob": {"prob": 0.01}}),
                              dict(thinking_budget=rng.randrange(3), thinking_start_token_ids=[3],
                                   thinking_end_token_ids=[9, 10], thinking_forced_token_ids=[8, 9, 10])]))
    return params


def _mask(rows: int, rng: random.Random, slots: int = 0):
    """None, or a random token bitmask on the host or the device (every row keeps token 0)."""
    choice = rng.choice(["none", "host", "device"])
    if choice == "none":
        return None
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    allowed = torch.rand((rows, slots or 1, V), generator=gen) < 0.5
    allowed[..., 0] = True
    words = pack_bitmask(allowed)
    words = words if slots else words[:, 0]
    return words.to(xla_device()) if choice == "device" else words


def _verify_step(sampler, batch, rng: random.Random, step: int):
    """A verify call with K drafts in one of the argument forms serving uses."""
    n = len(batch)
    padded = rng.random() < 0.3
    rows = batch.bucket() if padded else n
    gen = torch.Generator().manual_seed(step)
    drafts = torch.randint(0, V, (rows, K), generator=gen)
    drafts[::3, 1] = -1                                    # some rows propose fewer drafts
    probs = torch.softmax(torch.randn((rows, K, V), generator=gen), dim=-1)
    on_device = rng.random() < 0.5
    if on_device:
        drafts, probs = drafts.to(xla_device()), probs.to(xla_device())
    mask = None if padded else _mask(n, rng, slots=K + 1)
    out = sampler.verify(_logits(rows, step, slots=K + 1), batch, drafts,
                         probs if rng.random() < 0.5 else None, token_bitmask=mask,
                         method=rng.choice(["token", "block"]))
    assert out.token_ids.shape == (n, K + 1)
    return out.token_ids


def _churn(sampler, steps: int, max_rows: int, verify_share: float, seed: int) -> dict:
    """Random adds, removes, swaps, and sample or verify steps with their results appended;
    returns how many of each ran."""
    rng = random.Random(seed)
    batch = sampler.new_batch(V, eos_token_id=1)
    kinds = {"sample": 0, "verify": 0, "swap": 0, "remove": 0}
    for step in range(steps):
        if len(batch) < max_rows - 2 and rng.random() < 0.6:
            params = _random_params(rng)
            if len(batch) + params.get("n", 1) <= max_rows:
                batch.add(f"r{step}", SamplingParams(**params), prompt_token_ids=[1, 2, 3],
                          output_token_ids=[4] * rng.randrange(3) if params.get("n", 1) == 1 else None)
        if len(batch) > 2 and rng.random() < 0.3:
            batch.remove(rng.choice(batch.request_ids))
            kinds["remove"] += 1
        if len(batch) > 1 and rng.random() < 0.3:
            batch.swap_rows(*rng.sample(range(len(batch)), 2))
            kinds["swap"] += 1
        if not len(batch):
            continue
        if rng.random() < verify_share:
            batch.append(_verify_step(sampler, batch, rng, step))
            kinds["verify"] += 1
            continue
        form = rng.choice(["rows", "requests", "padded", "bf16"] if not verify_share else ["rows", "padded"])
        if form == "requests":
            logits = _logits(batch.num_requests, step)
        elif form == "padded":
            logits = _logits(batch.bucket(), step)
        else:
            logits = _logits(len(batch), step, torch.bfloat16 if form == "bf16" else torch.float32)
        mask = _mask(len(batch), rng) if form == "rows" else None
        out = sampler.sample(logits, batch, token_bitmask=mask)
        assert out.token_ids.shape == (len(batch),)
        batch.append(torch.where(out.valid, out.token_ids, 0))
        kinds["sample"] += 1
    return kinds


def test_nothing_compiles_after_warmup_under_churn(warm):
    """Parameter values change, features (the filters 10a-13b, DRY, custom stages, token
    bitmasks on the host or the device) switch on and off per row, requests join and leave
    (within and across buckets), rows swap, seeds vary, logits come per row, per request,
    padded and in bfloat16, logprobs come and go: strict mode would raise on any compile."""
    sampler, _, _ = warm
    before = compile_count()
    kinds = _churn(sampler, steps=60, max_rows=16, verify_share=0.0, seed=0)
    assert kinds["sample"] >= 40 and kinds["swap"] >= 10 and kinds["remove"] >= 5, kinds
    assert compile_count() == before
    assert sampler.guard.compiled_after_warmup == 0


def test_strict_mode_raises_on_an_unwarmed_shape(warm):
    sampler, _, _ = warm
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1))
    with pytest.raises(RecompilationError, match=r"sample \(bucket 8"):
        sampler.sample(_logits(1, 0, torch.float16), batch)      # float16 was not warmed up
    sampler.sample(_logits(1, 0, torch.bfloat16), batch)         # bfloat16 was


def test_a_step_reads_back_one_tensor_and_never_falls_back_to_the_host():
    """sample and verify (by the token rule and as a block, with reasoning budgets) each cost
    one device-to-host transfer (``TransferFromDeviceTime``), and no operation of theirs runs
    on the host (torch-xla counts such fallbacks as ``aten::*``:
    ``cumprod`` is one in torch-xla 2.9)."""
    import torch_xla.debug.metrics as met
    sampler = _sampler()
    batch = sampler.new_batch(V)
    for i in range(3):
        batch.add(f"r{i}", SamplingParams(seed=i, logprobs=2, top_k=5, typical_p=0.9, xtc_probability=0.5,
                                          dry_multiplier=1.0, stage_args={"ban-repeats": {"times": 1}},
                                          thinking_budget=i, thinking_start_token_ids=[7],
                                          thinking_end_token_ids=[8]), prompt_token_ids=[7])
    logits, slots = _logits(3, 0), _logits(3, 1, slots=K + 1)
    drafts = torch.tensor([[1, 2], [3, -1], [5, 6]]).to(xla_device())
    probs = torch.full((3, K, V), 1.0 / V).to(xla_device())
    words = pack_bitmask(torch.rand((3, K + 1, V), generator=torch.Generator().manual_seed(0)) < 0.5)

    def fallbacks():
        return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}
    for call in (lambda: sampler.sample(logits, batch, words[:, 0]),
                 lambda: sampler.verify(slots, batch, drafts, probs, words.to(xla_device())),
                 lambda: sampler.verify(slots, batch, drafts, probs, method="block")):
        call()                                                   # compiles
        before, host_ops = met.metric_data("TransferFromDeviceTime")[0], fallbacks()
        call()
        assert met.metric_data("TransferFromDeviceTime")[0] - before == 1
        assert fallbacks() == host_ops


def test_verify_graphs_one_per_draft_probs_and_method(warm_verify):
    """One verify graph per (bucket, K), way of judging (without draft probabilities, with
    them by the token rule, and block verification when asked for) and use of the stateful
    selectors (without, with)."""
    sampler, report = warm_verify
    assert report.speculative_k == (K,) and report.variants == 4
    graphs = report.step_graphs
    assert graphs == {("sample", 8): 4, ("verify", 8, K): 3 * 2}, graphs


def test_nothing_compiles_after_warmup_while_verifying(warm_verify):
    """Verification steps between plain ones: drafts (fewer than K in some rows), draft
    probabilities given or not (by the token rule or as a block), on the host or the device,
    reasoning budgets that force tokens at some slots, inputs with the live rows or padded
    to the bucket, acceptance counts that differ per row and step, token bitmasks per slot,
    the same parameter churn as above, rows swapped and removed: nothing compiles."""
    sampler, _ = warm_verify
    before = compile_count()
    kinds = _churn(sampler, steps=50, max_rows=8, verify_share=0.6, seed=1)
    assert kinds["verify"] >= 20 and kinds["sample"] >= 10 and kinds["swap"] >= 5, kinds
    assert compile_count() == before
    assert sampler.guard.compiled_after_warmup == 0


def test_strict_mode_raises_for_an_unconfigured_k(warm_verify):
    sampler, _ = warm_verify
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1))
    with pytest.raises(RecompilationError, match=r"padding verify logits"):
        # K = 1 runs in the K = 2 graph, but its logits need a padding graph of their own
        sampler.verify(_logits(1, 0, slots=2), batch, torch.tensor([[3]]))
    with pytest.raises(ValueError, match=r"K=3 .*speculative_k=\(2,\)"):
        sampler.verify(_logits(1, 0, slots=4), batch, torch.tensor([[3, 4, 5]]))


def test_strict_mode_names_the_flat_forms_gather(warm_verify):
    """verify's flat form gathers its logits into the padded slots with a graph per flat row
    count, which warm-up does not compile: strict mode raises naming it (docs/tpu.md)."""
    sampler, _ = warm_verify
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1))
    batch.add("b", SamplingParams(temperature=0.0))
    flat = torch.randn(4, V).to(xla_device())                       # 2 + 0 drafts, 2 bonus slots
    with pytest.raises(RecompilationError, match=r"verify's flat form \(4 logits rows, K 2\)"):
        sampler.verify(flat, batch, torch.tensor([3, 4]), num_drafts=[2, 0])
    assert batch.generated_counts() == [0, 0]


def _step_graphs_hlo(sampler: TpuSampler, bucket: int, vocab: int):
    """(what, HLO text) of every sample and verify graph of ``bucket`` rows, unoptimised as
    torch-xla lowers them (nothing is compiled)."""
    import torch_xla
    batch = sampler.new_batch(vocab)
    x = torch.zeros((bucket, vocab)).to(xla_device())
    xs = torch.zeros((bucket, K + 1, vocab)).to(xla_device())
    ids = torch.full((bucket, K), -1, dtype=torch.long).to(xla_device())
    probs = torch.zeros((bucket, K, vocab)).to(xla_device())
    mask = batch.padded_bitmask(None, bucket, K + 1)
    for variant in sampler.variants(batch):
        with sampler._forcing(variant):
            yield f"sample {variant}", torch_xla._XLAC._get_xla_tensors_hlo(
                [_pack(Sampler.sample(sampler, x, batch))])
    for q, method in ((None, "token"), (probs, "token"), (probs, "block")):
        out = _pack_verify(sampler._verify_padded(xs, batch, ids, q, mask, method))
        yield (f"verify probs={q is not None} method={method}",
               torch_xla._XLAC._get_xla_tensors_hlo([out]))


def test_no_vocabulary_wide_sort_but_tail_free_and_only_two_small_scatters():
    """No step or verify graph's HLO, as torch-xla lowers it, sorts a vocabulary-wide array
    but tail-free sampling (step 13c, defined on the sorted probabilities: one sort, inside
    its conditional, in the graphs that trace the filter group); the only scatters into one
    are bad words' ``B x max_bad_words`` bans and DRY's ``B x dry_window`` penalised logits.
    (Custom stages are the plugins' code and stay out of this check.)"""
    vocab, bucket, words = 1000, 8, 8
    sampler = TpuSampler(xla_device(), buckets=(bucket,), speculative_k=(K,), dry_window=DRY_WINDOW,
                         max_bad_words=words)
    for what, hlo in _step_graphs_hlo(sampler, bucket, vocab):
        lines = [line.strip() for line in hlo.splitlines()]
        sorts = [line[:160] for line in lines if " sort(" in line and f",{vocab}]" in line]
        filtering = what.startswith("verify") or "random=True" in what
        assert len(sorts) == int(filtering), f"{what}: {sorts}"
        scatters = [line for line in lines if " scatter(" in line and f",{vocab}]" in line]
        rows = bucket * (K + 1) if what.startswith("verify") else bucket
        operands = " ".join(line.split("scatter(", 1)[1] for line in scatters)
        updates = sorted(n for n in re.findall(rf"f32\[{rows},(\d+)\]", operands) if n != str(vocab))
        assert len(scatters) == 2 and updates == sorted([str(words), str(DRY_WINDOW)]), \
            f"{what}: {[line[:200] for line in scatters]}"


BITMASK_HLO = """
import torch, torch_xla
from corelib.sampler import Sampler
from corelib_tpu.layout import Variant
from corelib_tpu.transfer import pack as _pack
from corelib_tpu.sampler import TpuSampler
from corelib_tpu import xla
sampler = TpuSampler(torch_xla.device(), buckets=(8,), dry_window=16)
batch = sampler.new_batch(1000)
with sampler._forcing(Variant()):
    out = _pack(Sampler.sample(sampler, torch.zeros((8, 1000)).to(torch_xla.device()), batch))
xla.launch([out])
out.cpu()
"""


def test_bitmask_is_unpacked_inside_a_fusion(tmp_path):
    """In the optimised HLO of a step (XLA's own dump), the mask's words are unpacked only
    inside fused computations: no instruction outside a fusion produces the ``[B, W, 32]``
    bits, the flat ``[B, 32 W]`` bits or a ``[B, V]`` boolean or integer mask (the only
    materialised ``[B, V]`` arrays are float logits and the int8 code of the valid-row check).
    The branches of the conditional stages (DRY, the filters, the routes of steps 11-13) run
    after the mask on the masked logits and are left out."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
               PJRT_DEVICE="CPU")
    subprocess.run([sys.executable, "-c", BITMASK_HLO], env=env, check=True, capture_output=True)
    dumps = sorted(Path(tmp_path).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    text = dumps[-1].read_text()                                   # the step graph: the largest
    assert "s32[8,32]" in text, "the token bitmask is not an input of the step graph"
    fused = set(re.findall(r"calls=%([\w.\-]+)", text)) - set(re.findall(r"to_apply=%([\w.\-]+)", text))
    # the branches of the filters' conditionals, and their bisection loops, are the filters'
    # own work, after the mask
    branches = set(re.findall(r"(?:true|false)_computation=%([\w.\-]+)", text))
    branches |= set(re.findall(r"(?:body|condition)=%([\w.\-]+)", text))
    assert branches, "the step graph has no conditional"
    fused |= branches
    materialised = []
    for block in re.split(r"\n(?=%|ENTRY )", text):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block).group(1)
        if name in fused:
            continue
        for line in block.splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\]", line)
            if not m or "parameter(" in line:
                continue
            dtype, dims = m.groups()
            if dims in ("8,32,32", "8,1024") or dims == "8,1000" and dtype not in ("f32", "s8"):
                materialised.append(line.strip()[:160])
    assert not materialised, materialised


RANDOM_STEP_HLO = """
import sys, torch, torch_xla
from corelib.sampler import Sampler
from corelib_tpu.transfer import outputs, pack
from corelib_tpu.sampler import TpuSampler
from corelib_tpu import xla
B = int(sys.argv[1])
sampler = TpuSampler(torch_xla.device(), buckets=(B,), dry_window=16)
batch = sampler.new_batch(1000)
with sampler._forcing(sampler.variants(batch)[2]):
    out = Sampler.sample(sampler, torch.zeros((B, 1000)).to(torch_xla.device()), batch)
    xla.launch(outputs(pack(out), out))
out.token_ids.cpu()
"""


@pytest.mark.parametrize("bucket", [8, GROUP_CONDITIONAL_MIN_ROWS])
def test_a_random_step_passes_its_logits_through_few_conditionals(tmp_path, bucket):
    """In the optimised HLO of the folded random step (XLA's own dump), the conditionals of
    the top level. From ``GROUP_CONDITIONAL_MIN_ROWS`` rows on, the whole filter group is one
    conditional on "some row uses a filter few batches use" (its other branch: step 10's
    division and the route of steps 11-13 alone), so the only conditional that returns
    ``[B, V]`` logits is that one, with the route's candidate ids and edges beside them; in
    smaller buckets, the filters few batches use share one conditional before the route and
    one after it, so the conditionals that return logits are those two and the route, with
    the ids and edges. DRY's returns its penalties, ``[B, H]`` (or XLA makes it a select of
    them: either way no logits); and the kept sets are a conditional of their own, not a
    select that XLA's conditional simplifier made of elementwise branches (which packs the
    bits at every step)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
               PJRT_DEVICE="CPU")
    subprocess.run([sys.executable, "-c", RANDOM_STEP_HLO, str(bucket)], env=env, check=True,
                   capture_output=True)
    dumps = sorted(Path(tmp_path).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    text = dumps[-1].read_text()                                   # the step graph: the largest
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    results = re.findall(r"= \(([^)]*)\) conditional\(", entry)
    logits = [r for r in results if r.startswith(f"f32[{bucket},1000]{{1,0}}")]
    # the group's conditional, or the route, also returns the candidate ids and edges the
    # draw races over
    routed = f"f32[{bucket},1000]{{1,0}}, s64[{bucket},64]{{1,0}}, f32[{bucket},3]{{1,0}}"
    if bucket >= GROUP_CONDITIONAL_MIN_ROWS:
        assert logits == [routed], results
    else:
        assert len(logits) == 3 and routed in logits, results
    assert f"s32[{bucket},32]{{1,0}}" in results, results                     # the kept sets
