"""Thinking budgets inside vLLM: ``thinking_token_budget`` with the engine's reasoning markers is
corelib's step 8b. In greedy decoding corelib forces the end marker at the positions and with
the tokens vLLM's own sampler forces it; seeded requests sample what corelib's transformers
loop samples; under speculation the budget holds at every verification slot. Where vLLM's
sampler departs from corelib's contract, the tests say so (docs/vllm.md lists the cases)."""

from __future__ import annotations

import shutil

import pytest
from vllm.exceptions import VLLMValidationError

import corelib
from corelib.integrations.vllm.params import ThinkingMarkers, corelib_params, thinking_markers

from conftest import (
    NEW_FEATURES_BACKEND,
    THINK_PHRASE_END,
    Speculation,
    first,
    hf_generate,
    make_llm,
    reasoning_config,
    run,
    runner_of,
    vllm_params,
)

LENGTH = 16


def markers_of(llm) -> ThinkingMarkers:
    return thinking_markers(llm.llm_engine.vllm_config.reasoning_config)


def cases(markers: ThinkingMarkers) -> dict[str, tuple[list[int], int, int | None]]:
    """name -> (prompt, thinking_token_budget, where the forced sequence starts in the output:
    None when the row never reaches its budget)."""
    (start,), end = markers.start, list(markers.end)
    return {
        "budget 0, the prompt opens thinking": ([1, 17, 42, start], 0, 0),
        "a small budget": ([1, 300, start], 3, 3),
        "the prompt is already thinking": ([1, 5, 6, start, 99, 7], 4, 2),
        "the prompt thought past the budget": ([1, start, 5, 6, 7, 8, 9], 2, 0),
        "the model opens thinking itself": ([1, 64], 2, 3),
        "the prompt's section is closed": ([1, start, 99] + end + [7], 0, None),
        "never thinking": ([1, 17, 42, 99, 7], 2, None),
    }


def greedy(budget):
    return vllm_params(temperature=0.0, max_tokens=LENGTH, thinking_token_budget=budget)


def forced_at(tokens: list[int], at: int, forced: list[int]) -> bool:
    """The forced sequence starts at ``at``, and not before."""
    return tokens[at:at + len(forced)] == forced and forced[0] not in tokens[:at]


# ---------------------------------------------------------------------- mapping
def test_the_reasoning_config_gives_corelibs_markers(new_llm, phrase_llm):
    """Start ids open a section; the natural end ids close one; the forced end ids (a
    transition phrase, then the end marker) are what the budget forces."""
    plain = markers_of(new_llm)
    assert len(plain.start) == 1 and len(plain.end) == 6 and plain.forced == plain.end
    phrase = markers_of(phrase_llm)
    assert (phrase.start, phrase.end) == (plain.start, plain.end)
    assert len(phrase.forced) > len(phrase.end) and phrase.forced[-len(phrase.end):] == phrase.end
    tokenizer = phrase_llm.get_tokenizer()
    assert tokenizer.decode(list(phrase.forced)) == THINK_PHRASE_END
    mapped = corelib_params(vllm_params(thinking_token_budget=7), 512, thinking=phrase)
    assert (mapped.thinking_budget, mapped.thinking_start_token_ids, mapped.thinking_end_token_ids,
            mapped.thinking_forced_token_ids) == (7, list(phrase.start), list(phrase.end),
                                                  list(phrase.forced))
    assert corelib_params(vllm_params(), 512, thinking=phrase).thinking_budget is None


def test_the_sampler_reports_the_budget(new_llm):
    sampler = runner_of(new_llm).sampler
    assert sampler.corelib.name == NEW_FEATURES_BACKEND
    assert "thinking budget -> corelib step 8b" in sampler.describe()["patched"]


# ---------------------------------------------------------------------- vLLM's sampler as oracle
def test_greedy_budgets_force_what_vllms_sampler_forces(new_llm, new_vllm_llm):
    """Budget 0, a small budget, a prompt already thinking (within and past its budget), a
    section the model opens itself, a closed section and no section: the six-token end marker
    comes where vLLM's own sampler puts it, token for token."""
    markers = markers_of(new_llm)
    table = cases(markers)
    prompts = [prompt for prompt, _, _ in table.values()]
    params = [greedy(budget) for _, budget, _ in table.values()]
    ours = first(run(new_llm, prompts, params))
    assert ours == first(run(new_vllm_llm, prompts, params))
    for tokens, (name, (_, _, at)) in zip(ours, table.items()):
        assert at is None or forced_at(tokens, at, list(markers.forced)), name
    plain = first(run(new_llm, prompts, greedy(None)))
    assert [p != o for p, o in zip(plain, ours)] == [at is not None for _, _, at in table.values()]


def test_a_transition_phrase_is_forced_before_the_end_marker(phrase_llm, phrase_vllm_llm):
    """A parser's end marker with a phrase forced before it: the phrase and the marker come
    where vLLM's sampler puts them."""
    markers = markers_of(phrase_llm)
    table = {name: case for name, case in cases(markers).items() if case[2] is not None}
    prompts = [prompt for prompt, _, _ in table.values()]
    params = [greedy(budget) for _, budget, _ in table.values()]
    ours = first(run(phrase_llm, prompts, params))
    assert ours == first(run(phrase_vllm_llm, prompts, params))
    for tokens, (name, (_, _, at)) in zip(ours, table.items()):
        assert forced_at(tokens, at, list(markers.forced)), name


def test_the_natural_end_marker_closes_a_section(phrase_llm, phrase_vllm_llm):
    """A prompt whose section ends with the parser's end marker (without the phrase) is not
    thinking: the budget forces nothing. (vLLM's V1 sampler recognises only the forced ids as
    an end, so it still forces the phrase; its V2 runner reads the natural end, as corelib.)"""
    markers = markers_of(phrase_llm)
    prompt = [1, *markers.start, 99, *markers.end, 7]
    ours = first(run(phrase_llm, [prompt], greedy(0)))[0]
    assert ours == first(run(phrase_llm, [prompt], greedy(None)))[0]
    assert first(run(phrase_vllm_llm, [prompt], greedy(0)))[0][:len(markers.forced)] == list(markers.forced)


def test_a_start_marker_inside_a_section_starts_the_count_again(new_llm, new_vllm_llm):
    """The model writes the start marker again while thinking: corelib counts from the last
    one (the contract), vLLM's sampler from the first, so vLLM forces earlier."""
    markers = markers_of(new_llm)
    prompt, budget = [1, 300], 5
    ours = first(run(new_llm, [prompt], vllm_params(temperature=0.0, max_tokens=24,
                                                    thinking_token_budget=budget)))[0]
    at = ours.index(markers.forced[0])
    starts = [i for i, t in enumerate(ours[:at]) if t == markers.start[0]]
    assert len(starts) >= 2 and at == starts[-1] + 1 + budget
    theirs = first(run(new_vllm_llm, [prompt], vllm_params(temperature=0.0, max_tokens=24,
                                                           thinking_token_budget=budget)))[0]
    assert theirs.index(markers.forced[0]) == starts[0] + 1 + budget


# ---------------------------------------------------------------------- seeded: corelib's tokens
def test_seeded_budgets_sample_what_corelib_samples_in_transformers(new_llm, hf_model):
    markers = markers_of(new_llm)
    table = cases(markers)
    prompts = [prompt for prompt, _, _ in table.values()]
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95)
    ours = first(run(new_llm, prompts, [vllm_params(seed=30 + i, max_tokens=LENGTH,
                                                    thinking_token_budget=budget, **sampling)
                                        for i, (_, budget, _) in enumerate(table.values())]))
    corelib_params_ = [corelib.SamplingParams(
        seed=30 + i, thinking_budget=budget, thinking_start_token_ids=list(markers.start),
        thinking_end_token_ids=list(markers.end), **sampling)
        for i, (_, budget, _) in enumerate(table.values())]
    assert ours == first(hf_generate(hf_model, prompts, corelib_params_, max_new_tokens=LENGTH,
                                     backend=NEW_FEATURES_BACKEND))
    for tokens, (name, (_, _, at)) in zip(ours, table.items()):
        if at == 0:      # the one position that the sampled tokens cannot move
            assert forced_at(tokens, at, list(markers.forced)), name


# ---------------------------------------------------------------------- speculation
def test_budgets_hold_at_every_verification_slot(new_ngram_llm, new_llm):
    """ngram drafts around the forced end marker (the prompts hold the marker, so ngram
    proposes its continuation): every slot sees the thinking state with the slot's drafts
    appended, so greedy and seeded completions equal those without speculation."""
    markers = markers_of(new_llm)
    (start,), end = markers.start, list(markers.end)
    prompts = [[1, start, 99] + end + [7, start, 5], [1, start, 17, 42, 17, 42, 17],
               [1, 300, start], [1, start] + end[:3] + [9, 9, 9]]
    budgets = [3, 2, 0, 4]
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, top_k=50)):
        params = [vllm_params(max_tokens=LENGTH, seed=50 + i, thinking_token_budget=b, **sampling)
                  for i, b in enumerate(budgets)]
        spec = Speculation(new_ngram_llm, prompts, params)
        assert spec.stats["accepted_tokens"] > 0
        assert spec.tokens == first(run(new_llm, prompts, params))
        assert all(end[0] in tokens for tokens in spec.tokens)


# ---------------------------------------------------------------------- bad input
def test_a_budget_without_markers_fails_that_request(corelib_llm):
    """The engine has no reasoning config: vLLM's own validation names the field; so does
    corelib's mapping. The engine goes on."""
    with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
        run(corelib_llm, [[1, 2, 3]], greedy(4))
    with pytest.raises(ValueError, match="thinking_token_budget=4 needs the engine's reasoning markers"):
        corelib_params(greedy(4), 512)
    assert len(first(run(corelib_llm, [[1, 2, 3]], greedy(None)))[0]) == LENGTH


@pytest.mark.parametrize("key", ["thinking_budget", "thinking_start_token_ids",
                                 "thinking_end_token_ids", "thinking_forced_token_ids"])
def test_corelibs_thinking_fields_are_not_extra_args(key):
    """Under corelib's key they are refused with the field to use instead; at the top level of
    extra_args a key corelib does not take from there belongs to other code."""
    with pytest.raises(ValueError, match=f"extra_args\\['corelib'\\]\\['{key}'\\]: the reasoning "
                                         f"budget is vLLM's thinking_token_budget"):
        corelib_params(vllm_params(extra_args={"corelib": {key: 3}}), 512)
    assert corelib_params(vllm_params(extra_args={key: 3}), 512).thinking_budget is None


def test_a_forced_end_that_does_not_end_with_the_end_marker_stops_the_engine(model_dir,
                                                                             thinking_parser):
    from vllm.config.reasoning import ReasoningConfig
    with pytest.raises(Exception, match="forced end .*' OK'.* does not end with its natural "
                                        "end .*the reasoning parser's end marker"):
        make_llm(model_dir, NEW_FEATURES_BACKEND, reasoning_parser=thinking_parser,
                 reasoning_config=ReasoningConfig(reasoning_end_str=" OK"))


def test_markers_outside_the_vocabulary_stop_the_engine(model_dir, tmp_path):
    """A model whose vocabulary (300) is smaller than its tokenizer's (512): " by" is id 385."""
    import tiny_llama
    small = tmp_path / "small-vocab"
    tiny_llama.make_model(small, vocab_size=300)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, small / name)
    with pytest.raises(Exception, match="reasoning_start_token_ids \\[385\\] hold token id 385, "
                                        "out of range for the model's vocabulary of 300"):
        make_llm(small, NEW_FEATURES_BACKEND, reasoning_config=reasoning_config())
