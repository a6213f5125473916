"""vLLM's CPU engine, in this process, on a tiny random Llama made for the session.

This suite runs with the vLLM venv's interpreter (scripts/test.sh); elsewhere it is not
collected, unless CORELIB_REQUIRE_VLLM is set, which makes a missing vLLM an error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))   # tiny_llama, shared with the benchmark
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    if os.environ.get("CORELIB_REQUIRE_VLLM"):
        raise RuntimeError("CORELIB_REQUIRE_VLLM is set but vLLM is not installed")
    collect_ignore_glob = ["test_*.py"]
else:
    # vLLM reads these when it starts.
    os.environ.update({
        "CORELIB_VLLM": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core and worker in this process
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    # vLLM loads its plugins once per process, at the first engine: load them now, while
    # CORELIB_VLLM is set, whichever engine a test starts first.
    from vllm.plugins import load_general_plugins
    load_general_plugins()

MAX_NUM_SEQS = 4   # fewer than most tests' prompts: requests join and leave mid-generation
# KV cache per engine: room for 64k tokens of the tiny model, far more than the tests use. The
# suite keeps about ten engines alive; vLLM's CPU cache is allocated up front.
KV_CACHE_BYTES = 64 << 20
PROMPTS = [[1, 17, 42, 99, 7], [1, 300], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
           [1, 250, 251, 252], [1, 64], [1, 90, 91, 92, 93, 94, 95]]
TOKENS = 12
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02)
# Speculative decoding with vLLM's ngram drafter (proposals from the prompt and output).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}

# The backend of the engines that test the third release's features (thinking budgets, the
# logits modes, any number of logprobs, block verification): cpu, as everywhere else in the
# suite; CORELIB_VLLM_NEW_FEATURES=reference runs them on the oracle instead.
NEW_FEATURES_BACKEND = os.environ.get("CORELIB_VLLM_NEW_FEATURES", "cpu")
# Reasoning markers for the tiny model, which has no reasoning parser: vLLM's ReasoningConfig
# tokenises them (" by", one token the model writes itself; "</think>", six tokens).
THINK_START, THINK_END = " by", "</think>"
# A reasoning parser registered by the suite (``thinking_parser``) ends thinking with
# THINK_END; the config forces a transition phrase before it.
THINK_PARSER, THINK_PHRASE_END = "corelib-test-thinking", " OK</think>"


@contextlib.contextmanager
def corelib_vllm(value):
    """CORELIB_VLLM set to ``value`` (None: unset) for the duration."""
    old = os.environ.get("CORELIB_VLLM")
    if value is None:
        os.environ.pop("CORELIB_VLLM", None)
    else:
        os.environ["CORELIB_VLLM"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CORELIB_VLLM", None)
        else:
            os.environ["CORELIB_VLLM"] = old


def make_llm(model_dir: Path, backend, **kwargs):
    """A vLLM ``LLM`` on the tiny model; ``backend`` is CORELIB_VLLM while it starts."""
    from vllm import LLM
    options = dict(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                   max_num_seqs=MAX_NUM_SEQS, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES)
    options.update(kwargs)
    with corelib_vllm(backend):
        return LLM(**options)


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def vllm_params(**kwargs):
    from vllm import SamplingParams
    kwargs.setdefault("max_tokens", TOKENS)
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(**kwargs)


def generate(llm, prompts, params):
    """vLLM's CompletionOutputs, one list per prompt (completion index order)."""
    from vllm.inputs import TokensPrompt
    if not isinstance(params, list):
        params = [params] * len(prompts)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [sorted(o.outputs, key=lambda c: c.index) for o in outs]


def run(llm, prompts, params) -> list[list[list[int]]]:
    """Token ids per prompt, per completion (vLLM's completion index order)."""
    return [[list(c.token_ids) for c in outs] for outs in generate(llm, prompts, params)]


def first(results):
    return [completions[0] for completions in results]


class Speculation:
    """The completions of one generate call and the drafts corelib verified meanwhile."""

    def __init__(self, llm, prompts, params):
        stats = runner_of(llm).sampler.speculation
        before = stats.as_dict()
        self.completions = first(generate(llm, prompts, params))
        after = stats.as_dict()
        self.stats = {key: after[key] - before[key] for key in ("verified_rows", "draft_tokens",
                                                                 "accepted_tokens")}
        self.by_position = [a - b for a, b in zip(after["accepted_by_position"],
                                                  before["accepted_by_position"] + [0] * 8)]

    @property
    def tokens(self) -> list[list[int]]:
        return [list(c.token_ids) for c in self.completions]

    def vllm_totals(self) -> dict[str, int]:
        """The same totals from vLLM's per-request metrics (its scheduler's own counts)."""
        metrics = [c.spec_decode_metrics for c in self.completions]
        return {"verified_rows": sum(sum(m.histogram) for m in metrics),
                "draft_tokens": sum(m.num_draft_tokens for m in metrics),
                "accepted_tokens": sum(j * n for m in metrics for j, n in enumerate(m.histogram))}


def hf_generate(model, prompts, params, max_new_tokens=TOKENS, backend="cpu"):
    """corelib's own transformers loop (never stops early, as ignore_eos)."""
    import corelib
    from corelib.integrations import hf
    out = hf.generate(model, prompts, params, max_new_tokens=max_new_tokens, eos_token_id=[],
                      sampler=corelib.get_sampler(backend))
    return [[c.token_ids for c in children] for children in out.completions]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    import tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.make_model(path)
    return path


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def corelib_llm(model_dir):
    """vLLM sampling with corelib's cpu backend (raw logprobs)."""
    return make_llm(model_dir, "cpu")


@pytest.fixture(scope="session")
def processed_llm(model_dir):
    """corelib's sampler with logprobs_mode="processed_logprobs"."""
    return make_llm(model_dir, "cpu", logprobs_mode="processed_logprobs")


@pytest.fixture(scope="session")
def fresh_llm(model_dir):
    """An engine for one test that needs its first generate call (unseeded generator at its
    start). Engines stay alive for the session: vLLM's engines in one process share its
    distributed state, which a shut-down engine tears down for all."""
    return make_llm(model_dir, "cpu")


@pytest.fixture(scope="session")
def reference_llm(model_dir):
    """corelib's reference backend (the contract's oracle), for cross-backend agreement."""
    return make_llm(model_dir, "reference")


@pytest.fixture(scope="session")
def guidance_llm(model_dir):
    """The cpu backend with vLLM's guidance (llguidance) structured-output backend (the other
    engines use xgrammar, vLLM's default)."""
    return make_llm(model_dir, "cpu", structured_outputs_config={"backend": "guidance"})


@pytest.fixture(scope="session")
def ngram_llm(model_dir):
    """Speculative decoding (ngram drafts) verified by corelib's cpu backend, with vLLM's
    per-request acceptance metrics."""
    return make_llm(model_dir, "cpu", speculative_config=NGRAM,
                    per_request_spec_decode_metrics="summary")


@pytest.fixture(scope="session")
def draft_llm(model_dir):
    """A draft model (the target model itself) drafting by sampling, so vLLM hands its draft
    probabilities to the verification."""
    return make_llm(model_dir, "cpu", per_request_spec_decode_metrics="summary",
                    speculative_config={"method": "draft_model", "model": str(model_dir),
                                        "num_speculative_tokens": 3,
                                        "draft_sample_method": "probabilistic"})


@pytest.fixture(scope="session")
def vllm_llm(model_dir):
    """vLLM with its own sampler: CORELIB_VLLM unset while the engine starts."""
    return make_llm(model_dir, None)


def reasoning_config(start: str = THINK_START, end: str = THINK_END):
    from vllm.config.reasoning import ReasoningConfig
    return ReasoningConfig(reasoning_start_str=start, reasoning_end_str=end)


@pytest.fixture(scope="session")
def new_llm(model_dir):
    """NEW_FEATURES_BACKEND with the suite's reasoning markers and every logprob allowed
    (``max_logprobs=-1``)."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, reasoning_config=reasoning_config(),
                    max_logprobs=-1)


@pytest.fixture(scope="session")
def new_vllm_llm(model_dir):
    """vLLM's own sampler with the same settings (the oracle for the new features)."""
    return make_llm(model_dir, None, reasoning_config=reasoning_config(), max_logprobs=-1)


@pytest.fixture(scope="session")
def raw_logits_llm(model_dir):
    """NEW_FEATURES_BACKEND returning the model's logits (``logprobs_mode="raw_logits"``)."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, logprobs_mode="raw_logits", max_logprobs=-1)


@pytest.fixture(scope="session")
def processed_logits_llm(model_dir):
    """NEW_FEATURES_BACKEND returning the logits of the final distribution
    (``logprobs_mode="processed_logits"``)."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, logprobs_mode="processed_logits",
                    max_logprobs=-1)


@pytest.fixture(scope="session")
def thinking_parser():
    """The name of a vLLM reasoning parser whose markers are THINK_START and THINK_END,
    registered the way vLLM's reasoning-parser plugins register theirs."""
    from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager

    class ThinkingParser(ReasoningParser):
        @property
        def reasoning_start_str(self) -> str:
            return THINK_START

        @property
        def reasoning_end_str(self) -> str:
            return THINK_END

        def is_reasoning_end(self, input_ids) -> bool:
            return False

        def extract_content_ids(self, input_ids):
            return list(input_ids)

    ReasoningParserManager.register_module(THINK_PARSER, module=ThinkingParser)
    return THINK_PARSER


def phrase_options(parser: str) -> dict:
    """The parser's markers, with a transition phrase forced before its end marker."""
    from vllm.config.reasoning import ReasoningConfig
    return dict(reasoning_parser=parser,
                reasoning_config=ReasoningConfig(reasoning_end_str=THINK_PHRASE_END))


@pytest.fixture(scope="session")
def phrase_llm(model_dir, thinking_parser):
    return make_llm(model_dir, NEW_FEATURES_BACKEND, **phrase_options(thinking_parser))


@pytest.fixture(scope="session")
def phrase_vllm_llm(model_dir, thinking_parser):
    return make_llm(model_dir, None, **phrase_options(thinking_parser))


@pytest.fixture(scope="session")
def new_ngram_llm(model_dir):
    """new_llm's settings with ngram speculation (corelib's token rule)."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, reasoning_config=reasoning_config(),
                    max_logprobs=-1, speculative_config=NGRAM,
                    per_request_spec_decode_metrics="summary")


@pytest.fixture(scope="session")
def block_ngram_llm(model_dir):
    """ngram speculation with vLLM's rejection_sample_method="block" (corelib's block
    verification; ngram gives no draft probabilities, so rows keep the token rule)."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, per_request_spec_decode_metrics="summary",
                    speculative_config={**NGRAM, "rejection_sample_method": "block"})


@pytest.fixture(scope="session")
def block_draft_llm(model_dir):
    """A draft model (the target model itself) drafting by sampling, verified as a block.
    More rows per step than the other engines: its statistical test sends many requests."""
    return make_llm(model_dir, NEW_FEATURES_BACKEND, per_request_spec_decode_metrics="summary",
                    max_num_seqs=64,
                    speculative_config={"method": "draft_model", "model": str(model_dir),
                                        "num_speculative_tokens": 3,
                                        "draft_sample_method": "probabilistic",
                                        "rejection_sample_method": "block"})


@pytest.fixture(scope="session")
def processors_llm(model_dir):
    """corelib's cpu backend running the test suite's vLLM logits processors
    (``logits_processors.ALL``)."""
    import logits_processors
    return make_llm(model_dir, "cpu", logits_processors=logits_processors.ALL)


@pytest.fixture(scope="session")
def processors_vllm_llm(model_dir):
    """vLLM's own sampler with the same logits processors."""
    import logits_processors
    return make_llm(model_dir, None, logits_processors=logits_processors.ALL)
