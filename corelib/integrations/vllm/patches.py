"""Where corelib hooks into vLLM (0.32, V1 engine). vLLM has no sampler plugin interface, so
each hook wraps one vLLM method, in the process that imports its module:

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (the V1 runner; vLLM's CPU and
  XPU runners subclass it): afterwards the runner's ``sampler`` is a ``CorelibSampler``;
- ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__`` (the V2 runner): refused;
- ``vllm.v1.engine.input_processor.InputProcessor.process_inputs``: afterwards the request's
  final parameters (bad words tokenised, eos ids added) must map to corelib's, else the
  request fails with vLLM's validation error.

Structured outputs need no hook today: the V1 runner applies the grammar bitmask to the
logits (``apply_grammar_bitmask``) before it calls the sampler, so corelib samples the
constrained logits. Speculative decoding is refused at start-up: vLLM verifies drafts in its
own ``RejectionSampler``, which would sample the bonus tokens and recovered tokens itself.

Modules are patched when they are imported (or at once if they already are), so loading the
plugin imports nothing of vLLM's runner in processes that never build one. Each hook reads
``CORELIB_VLLM`` when it runs: a runner built while the variable is unset keeps vLLM's sampler.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
from typing import Any, Callable

from . import ENV_VAR, backend_choice

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
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


# ---------------------------------------------------------------------- the hooks
def _patch_v1_runner(module) -> None:
    def after_init(runner, result):
        choice = backend_choice()
        if choice is not None:
            attach_sampler(runner, choice)
    _wrap_after(module.GPUModelRunner, "__init__", after_init)


def attach_sampler(runner: Any, choice: str) -> None:
    """Give ``runner`` (a V1 ``GPUModelRunner``) corelib's sampler, or raise ValueError
    naming the engine setting corelib cannot honour."""
    from .sampler import LOGPROBS_MODES, CorelibSampler
    if runner.speculative_config is not None:
        raise ValueError(
            f"{ENV_VAR}: speculative decoding ({runner.speculative_config.method}) is not "
            f"supported yet: vLLM's rejection sampler would draw the tokens, not corelib")
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
