"""corelib sampling on a Hugging Face transformers causal LM, end to end, on tiny randomly
initialised models built here (no downloads). Skipped when transformers is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import corelib  # noqa: E402
from corelib import Sampler, SamplingParams  # noqa: E402
from corelib.integrations.hf import CorelibLogitsProcessor, generate  # noqa: E402

V = 128
PAD = 0
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
STEPS = 12
GREEDY = SamplingParams(temperature=0.0)


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return tiny_llama() if request.param == "llama" else tiny_gpt2()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def padded(prompts):
    """Left-padded ids and mask, as a transformers user passes them to generate."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_greedy(model, prompts, eos=None, **kwargs):
    ids, mask = padded(prompts)
    model.generation_config.eos_token_id = eos
    try:
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=STEPS,
                              pad_token_id=PAD, **kwargs)
    finally:
        model.generation_config.eos_token_id = None


def reference():
    return Sampler("cpu")


# ---------------------------------------------------------------------- greedy
def test_greedy_equals_transformers_greedy(model):
    out = generate(model, PROMPTS, GREEDY, max_new_tokens=STEPS, sampler=reference())
    assert torch.equal(out.sequences(PAD), hf_greedy(model, PROMPTS))
    assert [c.finish_reason for c in out.rows] == ["length"] * 3


def test_greedy_with_eos_equals_transformers_greedy(model):
    # An eos id the model actually produces: prompt 1's third greedy token. Rows that stop
    # leave corelib's batch (and the cache); transformers pads them instead.
    eos = int(hf_greedy(model, PROMPTS)[1, 5 + 2])
    out = generate(model, PROMPTS, GREEDY, max_new_tokens=STEPS, eos_token_id=eos, sampler=reference())
    want = hf_greedy(model, PROMPTS, eos=eos)
    assert torch.equal(out.sequences(PAD)[:, : want.shape[1]], want)
    stopped = out.completions[1][0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos and len(stopped.token_ids) <= 3


def test_tensor_input_with_attention_mask_equals_list_input(llama):
    ids, mask = padded(PROMPTS)
    a = generate(llama, ids, SamplingParams(seed=4), attention_mask=mask, max_new_tokens=6)
    b = generate(llama, PROMPTS, SamplingParams(seed=4), max_new_tokens=6)
    assert a.token_ids() == b.token_ids()
    assert torch.equal(a.prompt_ids, ids)


# ---------------------------------------------------------------------- seeds and n
def test_seeded_runs_reproduce_and_unseeded_runs_differ(llama):
    params = SamplingParams(seed=1234, temperature=1.0, top_p=0.95)
    first = generate(llama, PROMPTS, params, max_new_tokens=STEPS).token_ids()
    again = generate(llama, PROMPTS, params, max_new_tokens=STEPS).token_ids()
    other = generate(llama, PROMPTS, params.model_copy(update={"seed": 1235}), max_new_tokens=STEPS).token_ids()
    assert first == again
    assert all(a != b for a, b in zip(first, other)), "another seed must give other tokens"
    unseeded = [generate(llama, PROMPTS, SamplingParams(), max_new_tokens=STEPS).token_ids() for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_n_completions_differ_and_child_zero_equals_one_completion(llama):
    params = SamplingParams(n=4, seed=77, temperature=1.0)
    out = generate(llama, PROMPTS, params, max_new_tokens=STEPS)
    assert [len(children) for children in out.completions] == [4, 4, 4]
    for prompt, children in enumerate(out.completions):
        streams = [tuple(c.token_ids) for c in children]
        assert len(set(streams)) == 4, f"prompt {prompt}: children repeat each other: {streams}"
    single = generate(llama, PROMPTS, params.model_copy(update={"n": 1}), max_new_tokens=STEPS)
    assert [children[0].token_ids for children in out.completions] == single.token_ids()
    assert out.sequences(PAD).shape == (12, 5 + STEPS)


# ---------------------------------------------------------------------- per-prompt params
def test_per_prompt_params_in_one_batch(llama):
    greedy_alone = hf_greedy(llama, PROMPTS)
    eos = 3
    banned = int(greedy_alone[2, 5])             # prompt 2's first greedy token
    allowed = list(range(20, 30))
    params = [
        GREEDY,
        SamplingParams(seed=5, temperature=1.5, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, bad_words=[[banned]]),
        SamplingParams(seed=6, min_tokens=4, logit_bias={eos: 100.0}),
    ]
    prompts = PROMPTS + [[40, 41, 42]]
    out = generate(llama, prompts, params, max_new_tokens=STEPS, eos_token_id=eos)
    # a greedy prompt batched with sampled ones decodes as transformers' greedy does
    assert out.completions[0][0].token_ids == greedy_alone[0, 5:].tolist()
    assert set(out.completions[1][0].token_ids) <= set(allowed)
    assert banned not in out.completions[2][0].token_ids
    stopped = out.completions[3][0]
    assert stopped.token_ids[:4].count(eos) == 0, "min_tokens must hold eos back"
    assert stopped.token_ids[4:] == [eos] and stopped.finish_reason == "stop"


def test_repetition_penalty_equals_transformers(model):
    prompt = [[5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    out = generate(model, prompt, params, max_new_tokens=STEPS, sampler=reference())
    assert torch.equal(out.sequences(PAD), hf_greedy(model, prompt, repetition_penalty=1.5))


def test_frequency_and_presence_penalties_against_a_plain_loop(llama):
    """An independent oracle: the whole sequence through the model each step (no cache), the
    contract's step 8 by hand, argmax."""
    prompt, f, p = [5, 6, 7, 8, 9], 1.5, 0.75
    params = SamplingParams(temperature=0.0, frequency_penalty=f, presence_penalty=p)
    got = generate(llama, [prompt], params, max_new_tokens=STEPS).token_ids()[0]
    sequence, generated = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = llama(torch.tensor([sequence])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=V).double()
            logits = logits - f * counts - p * (counts > 0).double()
            token = int(torch.argmax(logits))
            sequence.append(token)
            generated.append(token)
    assert got == generated
    assert len(set(got)) > 3, "penalties should spread the tokens (the test must be able to fail)"


def test_logprobs_match_transformers_scores(llama):
    params = SamplingParams(temperature=0.0, logprobs=3)
    out = generate(llama, PROMPTS, params, max_new_tokens=4, sampler=reference())
    ids, mask = padded(PROMPTS)
    hf = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=PAD,
                        output_scores=True, return_dict_in_generate=True)
    for step, scores in enumerate(hf.scores):
        want = torch.log_softmax(scores.float(), dim=-1)
        top = torch.topk(want, 3, dim=-1)
        for row, completion in enumerate(out.rows):
            lp = completion.logprobs[step]
            assert lp.token_id == completion.token_ids[step] == int(hf.sequences[row, 5 + step])
            assert lp.rank == 1
            assert lp.logprob == pytest.approx(float(want[row, lp.token_id]), abs=1e-5)
            assert [t for t, _ in lp.top] == top.indices[row].tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values[row].tolist(), abs=1e-5)


# ---------------------------------------------------------------------- the logits processor
def test_logits_processor_equals_generate(llama):
    ids, mask = padded(PROMPTS)
    for params, extra in [(GREEDY, {}), (SamplingParams(seed=3, top_k=20), {}),
                          (SamplingParams(seed=3, n=3, repetition_penalty=1.2),
                           {"do_sample": True, "num_return_sequences": 3})]:
        processor = CorelibLogitsProcessor(params, attention_mask=mask, sampler=reference())
        hf = llama.generate(ids, attention_mask=mask, max_new_tokens=STEPS, pad_token_id=PAD,
                            logits_processor=[processor], **{"do_sample": False, **extra})
        ours = generate(llama, PROMPTS, params, max_new_tokens=STEPS, sampler=reference())
        assert torch.equal(hf, ours.sequences(PAD)), f"params {params}"
        assert len(processor.outputs) == STEPS


def test_logits_processor_restarts_on_a_new_generation(llama):
    ids, mask = padded(PROMPTS)
    processor = CorelibLogitsProcessor(SamplingParams(seed=9), attention_mask=mask)
    runs = [llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
                           pad_token_id=PAD, logits_processor=[processor]) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------- the fourth release
# The tiny models' logits spread about 0.6 from best to worst token: a low temperature spreads
# them as a trained model's, so that each filter keeps some tokens and drops others.
T = 0.05
NEW_SAMPLERS = {
    "dynatemp": dict(temperature=T, dynatemp_range=0.04, dynatemp_exponent=0.5),
    "smoothing": dict(temperature=T, smoothing_factor=0.5, smoothing_curve=2.0),
    "top-a": dict(temperature=T, top_a=0.2),
    "epsilon": dict(temperature=T, epsilon_cutoff=0.02),
    "eta": dict(temperature=T, eta_cutoff=0.5),
    "tfs": dict(temperature=T, tfs=0.6),
    "p-less": dict(temperature=T, p_less="plain"),
    "p-less-norm": dict(temperature=T, p_less="norm"),
    "sampler-order": dict(temperature=3 * T, top_k=12, min_p=0.3,
                          sampler_order=["top_k", "min_p", "temperature"]),
    "temperature-last": dict(temperature=3 * T, min_p=0.3, temperature_last=True),
    "mirostat": dict(temperature=T, mirostat_tau=2.0, mirostat_eta=0.5),
    "adaptive-p": dict(temperature=T, adaptive_p_target=0.2, adaptive_p_decay=0.7),
}
# Two prompts per request (seeds differ), so that rows with different states share the batch.
SAMPLER_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def per_prompt(case: dict) -> list[SamplingParams]:
    return [SamplingParams(seed=40 + i, **case) for i in range(len(SAMPLER_PROMPTS))]


def plain_loop(model, prompts, params, steps=STEPS) -> list[list[int]]:
    """An oracle independent of the integration's loop: the whole sequence through the model
    each step (no cache, no padding), the reference backend sampling one batch of the
    prompts, each step's tokens appended to it."""
    sampler = corelib.get_sampler("reference")
    batch = sampler.new_batch(V)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        batch.add(str(i), p, prompt_token_ids=prompt)
    sequences = [list(prompt) for prompt in prompts]
    with torch.no_grad():
        for _ in range(steps):
            logits = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in sequences])
            tokens = sampler.sample(logits.float(), batch).token_ids
            batch.append(tokens)
            for sequence, token in zip(sequences, tokens.tolist()):
                sequence.append(token)
    return [sequence[len(prompt):] for sequence, prompt in zip(sequences, prompts)]


@pytest.mark.parametrize("name", sorted(NEW_SAMPLERS))
def test_new_sampler_equals_a_plain_loop_and_acts(name, llama):
    """generate's tokens with each new sampler (the stateful selectors' state carried from
    step to step) are those of the plain loop, and differ from the same seeded requests
    without the sampler (for an order: in the default order)."""
    case = NEW_SAMPLERS[name]
    params = per_prompt(case)
    got = generate(llama, SAMPLER_PROMPTS, params, max_new_tokens=STEPS, sampler=reference())
    assert got.token_ids() == plain_loop(llama, SAMPLER_PROMPTS, params)
    without = per_prompt({k: v for k, v in case.items() if k in ("temperature", "top_k", "min_p")})
    assert got.token_ids() != generate(llama, SAMPLER_PROMPTS, without, max_new_tokens=STEPS,
                                       sampler=reference()).token_ids()


@pytest.mark.parametrize("name", ["mirostat", "adaptive-p"])
def test_selector_state_moves_through_the_loop(name, llama):
    """The selectors' state steers the tokens: a frozen state (mirostat_eta 0; adaptive-p's
    decay 0 keeps only the last token's probability) samples otherwise, and the logits
    processor, which appends each token at transformers' next call, equals generate."""
    case = NEW_SAMPLERS[name]
    frozen = {**case, "mirostat_eta": 0.0} if name == "mirostat" else {**case, "adaptive_p_decay": 0.0}
    moving = generate(llama, SAMPLER_PROMPTS, per_prompt(case), max_new_tokens=STEPS,
                      sampler=reference())
    assert moving.token_ids() != generate(llama, SAMPLER_PROMPTS, per_prompt(frozen),
                                          max_new_tokens=STEPS, sampler=reference()).token_ids()
    ids, mask = padded(SAMPLER_PROMPTS)
    processor = CorelibLogitsProcessor(per_prompt(case), attention_mask=mask, sampler=reference())
    hf = llama.generate(ids, attention_mask=mask, max_new_tokens=STEPS, pad_token_id=PAD,
                        do_sample=False, logits_processor=[processor])
    assert torch.equal(hf, moving.sequences(PAD))


def test_selector_children_keep_their_own_state(llama):
    """n = 3 mirostat children of one prompt (one logits row at the first step, one per child
    after): child 0 equals the request alone with n = 1, and the children differ."""
    params = SamplingParams(n=3, seed=41, **NEW_SAMPLERS["mirostat"])
    out = generate(llama, SAMPLER_PROMPTS[:1], params, max_new_tokens=STEPS, sampler=reference())
    children = [c.token_ids for c in out.completions[0]]
    alone = generate(llama, SAMPLER_PROMPTS[:1], params.model_copy(update={"n": 1}),
                     max_new_tokens=STEPS, sampler=reference()).token_ids()[0]
    assert children[0] == alone and len({tuple(c) for c in children}) == 3


def test_new_fields_bad_values_name_the_field(llama):
    with pytest.raises(ValueError, match="tfs"):
        generate(llama, PROMPTS, SamplingParams(tfs=0.0))
    with pytest.raises(ValueError, match="sampler_order"):
        generate(llama, PROMPTS, SamplingParams(sampler_order=["top_k", "top_k"]))


# ---------------------------------------------------------------------- errors and imports
def test_bad_inputs_raise_clear_errors(llama):
    ids, mask = padded(PROMPTS)
    with pytest.raises(ValueError, match="not left-padded"):
        generate(llama, ids, GREEDY, attention_mask=mask.flip(-1))
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        generate(llama, PROMPTS, [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(llama, PROMPTS, GREEDY, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(llama, [[4], []], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        generate(llama, [[4, V + 3]], GREEDY)
    with pytest.raises(ValueError, match="request '1'"):   # every token masked: flagged row
        generate(llama, [[4], [5]], [GREEDY, SamplingParams(allowed_token_ids=[7], bad_words=[[7]])])


def test_importing_the_integration_does_not_import_transformers():
    code = "import sys, corelib.integrations.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- kept sets for training
# A temperature that spreads the tiny model's logits as a trained model's, so that each filter
# drops tokens; child 0 of prompt 0 is greedy in the mixed case.
ROLLOUT = SamplingParams(seed=21, n=2, temperature=0.1, top_k=20, top_p=0.9, min_p=0.05)


def kept_bits(out) -> torch.Tensor:
    """bool [C, S, V] from the output's packed kept sets."""
    C, S, W = out.kept.shape
    return corelib.bitmask.unpack_bitmask(out.kept.reshape(C * S, W), V).view(C, S, V)


def stopping_eos(model, params) -> int:
    """A token the seeded rollout draws at step 3 of its first completion: with it as eos,
    that completion stops early and the others (mostly) run on."""
    return generate(model, PROMPTS, params, max_new_tokens=STEPS, sampler=reference()).rows[0].token_ids[3]


def score_batch(params: list[SamplingParams], eos: int, mode: str = "processed"):
    batch = reference().new_batch(V, eos_token_id=eos, logprobs_mode=mode)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        batch.add(str(i), p, prompt_token_ids=prompt)
    return batch


def test_kept_sets_are_the_finite_processed_logits_and_hold_the_drawn_token(llama):
    params = [SamplingParams(temperature=0.0, logprobs=-1)] + [
        ROLLOUT.model_copy(update={"logprobs": -1, "seed": 21 + i}) for i in range(2)]
    eos = stopping_eos(llama, params)
    out = generate(llama, PROMPTS, params, max_new_tokens=STEPS, eos_token_id=eos, sampler=reference(),
                   logprobs_mode="processed_logits", return_kept=True, return_logits=True)
    plain = generate(llama, PROMPTS, params, max_new_tokens=STEPS, eos_token_id=eos, sampler=reference())
    assert out.token_ids() == plain.token_ids(), "return_kept must not change a token"
    ids, bits = out.completion_ids(), kept_bits(out)
    C, S = ids.shape
    assert out.kept.dtype == torch.int32 and out.kept.shape == (C, S, (V + 31) // 32)
    assert out.logits.shape == (C, S, V) and out.logprobs.shape == (C, S)
    lengths = [len(c.token_ids) for c in out.rows]
    assert min(lengths) < S, "one completion must stop early (the zeros after it are checked)"
    truncated = 0
    for c, completion in enumerate(out.rows):
        for step, token in enumerate(completion.token_ids):
            values = torch.full((V,), float("nan"))
            top = completion.logprobs[step].top
            assert len(top) == V, "logprobs=-1 lists every token"
            values[torch.tensor([t for t, _ in top])] = torch.tensor([v for _, v in top])
            assert bool(bits[c, step, token])
            if completion.prompt_index == 0:
                # greedy: the argmax alone (its processed logits are step 8b's, all finite)
                assert bits[c, step].sum() == 1 and token == int(out.logits[c, step].argmax())
            else:
                assert torch.equal(bits[c, step], torch.isfinite(values)), f"completion {c}, step {step}"
                truncated += int(bits[c, step].sum() < V)
        assert not out.kept[c, len(completion.token_ids):].any()
        assert not out.logprobs[c, len(completion.token_ids):].any()
        assert not out.logits[c, len(completion.token_ids):].any()
        assert (ids[c, len(completion.token_ids):] == -1).all()
    assert truncated > 10, "the filters must drop tokens (the test must be able to fail)"


def test_score_on_the_rollouts_logits_equals_its_processed_logprobs_bitwise(llama):
    """What a trainer gets from ``score`` given the rollout's own logits, kept sets and tokens,
    on a fresh batch of the same requests: the rollout's processed logprobs, bitwise, with
    kept= and without (seeded and unseeded rows); padding reads 0."""
    params = [ROLLOUT, ROLLOUT.model_copy(update={"seed": None}), ROLLOUT.model_copy(update={"seed": 5})]
    eos = stopping_eos(llama, params[:1] * 3)
    out = generate(llama, PROMPTS, params, max_new_tokens=STEPS, eos_token_id=eos, sampler=reference(),
                   logprobs_mode="processed", return_kept=True, return_logits=True)
    ids = out.completion_ids()
    given = ids >= 0
    assert not given.all(), "one completion must stop early"
    # zeros after the end, also where a sibling still runs on the finished child's row
    assert not out.kept[~given].any() and not out.logprobs[~given].any()
    for kept in (out.kept, None):
        scored = reference().score(out.logits, score_batch(params, eos), ids, kept=kept)
        assert torch.equal(scored.logprobs[given], out.logprobs[given])
        assert scored.kept_token[given].all()
        assert not scored.logprobs[~given].any()
    # the logprobs are the processed ones: not the model's log_softmax
    raw = torch.log_softmax(out.logits, dim=-1).gather(-1, ids.clamp(min=0)[..., None])[..., 0]
    assert (raw[given] - out.logprobs[given]).abs().min() > 0.01


def test_return_kept_asks_every_request_and_checks_its_flags(llama):
    out = generate(llama, PROMPTS, [GREEDY, SamplingParams(seed=1, logprobs=2), SamplingParams(seed=2)],
                   max_new_tokens=3, return_kept=True)
    assert [len(c.logprobs) for c in out.rows] == [3, 3, 3]
    assert [len(c.logprobs[0].top) for c in out.rows] == [0, 2, 0]
    assert out.logits is None and bool((out.kept != 0).any(dim=-1).all())
    assert generate(llama, PROMPTS, GREEDY, max_new_tokens=2).kept is None
    with pytest.raises(ValueError, match="return_kept"):
        generate(llama, PROMPTS, GREEDY, return_kept=1)
    with pytest.raises(ValueError, match="return_logits"):
        generate(llama, PROMPTS, GREEDY, return_logits="yes")


def test_score_in_chunks_with_append_between_equals_one_call(llama):
    """A trainer scoring a long rollout chunk by chunk (score, append the chunk, go on) gets
    one call's values bitwise, with kept= and without; without, the mirostat state moved by
    the appends reproduces the rollout's processed logprobs."""
    params = [SamplingParams(seed=30 + i, temperature=0.1, mirostat_tau=3.0, repetition_penalty=1.3)
              for i in range(len(PROMPTS))]
    out = generate(llama, PROMPTS, params, max_new_tokens=STEPS, sampler=reference(),
                   logprobs_mode="processed", return_kept=True, return_logits=True)
    ids = out.completion_ids()
    for kept in (out.kept, None):
        whole = reference().score(out.logits, score_batch(params, None), ids, kept=kept).logprobs
        batch, parts = score_batch(params, None), []
        for start in range(0, ids.shape[1], 5):
            part = slice(start, start + 5)
            parts.append(reference().score(out.logits[:, part], batch, ids[:, part],
                                           kept=None if kept is None else kept[:, part]).logprobs)
            batch.append(ids[:, part])
        assert torch.equal(torch.cat(parts, dim=1), whole)
        assert torch.equal(whole, out.logprobs)
