"""Where corelib hooks into vLLM (0.32, V1 engine). vLLM has no sampler plugin interface, so
each hook wraps or replaces one vLLM function, in the process that imports its module:

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (the V1 runner; vLLM's CPU and
  XPU runners subclass it): afterwards the runner's ``sampler`` is a ``CorelibSampler`` and,
  with speculative decoding, its ``rejection_sampler`` is corelib's verification;
- ``vllm.v1.worker.gpu_model_runner.apply_grammar_bitmask`` (the name the runner calls before
  sampling): for a runner that samples with corelib, the grammar bitmask goes to the sampler
  instead of into the logits (``grammar``);
- ``GPUModelRunner.sample_tokens``: the requests corelib flagged in the step (no token left to
  sample) travel to the scheduler with the runner's output;
- ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``: finishes those requests as
  per-request errors (vLLM's ``FINISHED_ERROR``, finish reason ``"error"``, the reason in
  ``stop_reason``), so the engine and the other requests go on;
- ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__`` (the V2 runner): refused;
- ``vllm.v1.engine.input_processor.InputProcessor.process_inputs``: afterwards the request's
  final parameters (bad words tokenised, eos ids added) must map to corelib's, else the
  request fails with vLLM's validation error;
- ``vllm.sampling_params.SamplingParams._validate_spec_decode``: vLLM refuses min_p and
  logit_bias under speculative decoding (its rejection sampler skips them); corelib applies
  every stage at every verification slot, so with ``CORELIB_VLLM`` set they are accepted.

Modules are patched when they are imported (or at once if they already are), so loading the
plugin imports nothing of vLLM's runner in processes that never build one. Each hook reads
``CORELIB_VLLM`` when it runs: a runner built while the variable is unset keeps vLLM's sampler.
"""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import os
import sys
from typing import Any, Callable

from . import ENV_VAR, backend_choice

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SAMPLING_PARAMS_MODULE = "vllm.sampling_params"
# The attribute of a ModelRunnerOutput that carries the step's flagged requests (request id ->
# why) from the worker to the scheduler; it travels with the output (pickled between processes).
FAILURES_ATTRIBUTE = "corelib_failures"
# The rejection-sampling method corelib's verify implements (vLLM's "synthetic" and "block"
# accept drafts by other rules).
STANDARD_REJECTION = "standard"
# vLLM's built-in logits processors; corelib implements what they do (min_tokens,
# logit_bias, min_p) from the request's parameters.
BUILTIN_LOGITS_PROCESSORS = {"MinTokensLogitsProcessor", "LogitBiasLogitsProcessor",
                             "MinPLogitsProcessor"}

_installed = False


def install() -> None:
    """Install every hook (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    # corelib samples in the V1 runner; V2 becomes vLLM's default where it can run (CUDA).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    when_imported(V1_RUNNER_MODULE, _patch_v1_runner)
    when_imported(V2_RUNNER_MODULE, _refuse_v2_runner)
    when_imported(INPUT_PROCESSOR_MODULE, _patch_input_processor)
    when_imported(SCHEDULER_MODULE, _patch_scheduler)
    when_imported(SAMPLING_PARAMS_MODULE, _patch_spec_decode_validation)


# ---------------------------------------------------------------------- the hooks
def _patch_v1_runner(module) -> None:
    from .grammar import routed_apply_grammar_bitmask
    from .sampler import CorelibSampler, sampler_for

    def after_init(runner, result):
        choice = backend_choice()
        if choice is not None:
            attach_sampler(runner, choice)
    _wrap_after(module.GPUModelRunner, "__init__", after_init)

    def with_failures(runner, output):
        sampler = runner.sampler
        if not isinstance(sampler, CorelibSampler):
            return output
        failures = sampler.take_failures()
        if failures:
            output = copy.copy(output)       # never tag vLLM's shared empty output
            setattr(output, FAILURES_ATTRIBUTE, failures)
        return output
    _wrap_result(module.GPUModelRunner, "sample_tokens", with_failures)
    module.apply_grammar_bitmask = routed_apply_grammar_bitmask(module.apply_grammar_bitmask,
                                                                sampler_for)


def attach_sampler(runner: Any, choice: str) -> None:
    """Give ``runner`` (a V1 ``GPUModelRunner``) corelib's sampler (and corelib's draft
    verification when it decodes speculatively), or raise ValueError naming the engine
    setting corelib cannot honour."""
    from .sampler import LOGPROBS_MODES, CorelibSampler
    spec = runner.speculative_config
    if spec is not None and spec.rejection_sample_method != STANDARD_REJECTION:
        raise ValueError(
            f"{ENV_VAR}: speculative decoding with rejection_sample_method="
            f"{spec.rejection_sample_method!r} is not supported: corelib verifies drafts by "
            f"standard rejection sampling ({STANDARD_REJECTION!r})")
    mode = runner.model_config.logprobs_mode
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"{ENV_VAR}: logprobs_mode={mode!r} is not supported; corelib "
                         f"returns {sorted(LOGPROBS_MODES)}")
    custom = [type(p).__name__ for p in runner.input_batch.logitsprocs.all
              if type(p).__name__ not in BUILTIN_LOGITS_PROCESSORS]
    if custom:
        raise ValueError(f"{ENV_VAR}: custom logits processors {custom} are not supported: "
                         f"corelib's sampler does not run them")
    runner.sampler = CorelibSampler(runner, choice)
    if spec is not None:
        runner.rejection_sampler = runner.sampler.rejection_sampler


def _refuse_v2_runner(module) -> None:
    def before_init(runner, *args, **kwargs):
        if backend_choice() is None:
            return
        raise ValueError(f"{ENV_VAR} works with vLLM's V1 model runner; unset "
                         f"VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")
    _wrap_before(module.GPUModelRunner, "__init__", before_init)


def _patch_input_processor(module) -> None:
    from vllm.exceptions import VLLMValidationError

    from .params import corelib_params

    def after_process(processor, request):
        params = request.sampling_params
        if backend_choice() is None or params is None:
            return
        try:
            corelib_params(params, processor.model_config.get_vocab_size())
        except ValueError as exc:
            raise VLLMValidationError(f"corelib sampler ({ENV_VAR}): {exc}") from exc
    _wrap_after(module.InputProcessor, "process_inputs", after_process)


def _patch_spec_decode_validation(module) -> None:
    def validate(original, params, *args, **kwargs):
        if backend_choice() is None:
            return original(params, *args, **kwargs)
    _wrap_around(module.SamplingParams, "_validate_spec_decode", validate)


def _patch_scheduler(module) -> None:
    def update_from_output(original, scheduler, scheduler_output, model_runner_output):
        failures = getattr(model_runner_output, FAILURES_ATTRIBUTE, None)
        if not failures:
            return original(scheduler, scheduler_output, model_runner_output)
        finish_as_errors(scheduler, model_runner_output, failures)
        outputs = original(scheduler, scheduler_output, model_runner_output)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.request_id in failures:
                    output.stop_reason = failures[output.request_id]
        return outputs
    _wrap_around(module.Scheduler, "update_from_output", update_from_output)


def finish_as_errors(scheduler: Any, model_runner_output: Any, failures: dict[str, str]) -> None:
    """Before vLLM's scheduler reads the runner's output: the flagged requests keep no token
    from this step (in a plain step their row holds -1, which is no token), and join the
    scheduler's requests to finish as per-request errors in this update (the set it also
    uses for grammars that failed to compile)."""
    sampled = model_runner_output.sampled_token_ids
    for request_id in failures:
        row = model_runner_output.req_id_to_index.get(request_id)
        if row is not None and sampled:
            sampled[row] = []
    scheduler.grammar_compile_error_reqs.update(failures)


# ---------------------------------------------------------------------- mechanics
def _wrap_after(cls: type, name: str, hook: Callable) -> None:
    """``cls.name`` then ``hook(self, result)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        hook(self, result)
        return result
    setattr(cls, name, wrapper)


def _wrap_result(cls: type, name: str, transform: Callable) -> None:
    """``cls.name``, its result replaced by ``transform(self, result)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return transform(self, original(self, *args, **kwargs))
    setattr(cls, name, wrapper)


def _wrap_around(cls: type, name: str, hook: Callable) -> None:
    """``hook(original, self, *args, **kwargs)`` in place of ``cls.name``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)
    setattr(cls, name, wrapper)


def _wrap_before(cls: type, name: str, hook: Callable) -> None:
    """``hook(self, *args, **kwargs)`` then ``cls.name``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        hook(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    setattr(cls, name, wrapper)


def when_imported(module_name: str, patch: Callable[[Any], None]) -> None:
    """Call ``patch(module)`` once ``module_name`` is imported: now if it already is, else
    right after its code runs (an import hook that removes itself)."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


class _PatchOnImport:
    """A ``sys.meta_path`` finder for one module: finds it as the path finder would, and runs
    ``patch`` after the module's own code."""

    def __init__(self, module_name: str, patch: Callable[[Any], None]):
        self.module_name = module_name
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec
