"""corelib sampling on a Hugging Face transformers causal LM, end to end, on tiny randomly
initialised models built here (no downloads). Skipped when transformers is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

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
