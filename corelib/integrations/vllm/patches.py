"""Where corelib hooks into vLLM (0.32, V1 engine). vLLM has no sampler plugin interface, so
each hook wraps or replaces one vLLM function, in the process that imports its module:

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (the V1 runner; vLLM's CPU and
  XPU runners subclass it): afterwards the runner's ``sampler`` is a ``CorelibSampler`` and,
  with speculative decoding, its ``rejection_sampler`` is corelib's verification; vLLM's custom
  logits processors run as corelib stages (``processors``);
- ``vllm.v1.worker.gpu_model_runner.apply_grammar_bitmask`` (the name the runner calls before
  sampling): for a runner that samples with corelib, the grammar bitmask goes to the sampler
  instead of into the logits (``grammar``);
- ``GPUModelRunner.sample_tokens``: the requests corelib flagged in the step (no token left to
  sample) travel to the scheduler with the runner's output;
- ``vllm.v1.worker.gpu_input_batch.InputBatch.add_request``: a runner that samples with
  corelib keeps no per-request ``torch.Generator`` (corelib never draws from them, and vLLM
  rewinds them for tokens it discards, which vLLM's CPU build cannot do);
- ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``: finishes those requests as
  per-request errors (vLLM's ``FINISHED_ERROR``, finish reason ``"error"``, the reason in
  ``stop_reason``), so the engine and the other requests go on;
- ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__`` (the V2 runner): refused;
- ``vllm.v1.engine.input_processor.InputProcessor.process_inputs``: afterwards the request's
  final parameters (bad words tokenised, eos ids added) must map to corelib's, else the
  request fails with vLLM's validation error;
- ``vllm.v1.engine.parallel_sampling.ParentRequest._get_child_sampling_params`` (the front
  end splits a request with n > 1 into n requests): child i of a seeded request keeps the
  parent's seed and carries its index (``params.child_params``), where vLLM seeds it
  ``seed + i``;
- ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.__init__`` (the drafters that
  run a model: draft models, EAGLE, MTP): vLLM's drafter hands its draft probabilities to the
  verification only under ``rejection_sample_method="standard"``; with corelib's block
  verification (``"block"``) and ``draft_sample_method="probabilistic"`` it hands them on too,
  since block verification needs them (without them every row keeps the token rule);
- ``vllm.sampling_params.SamplingParams._validate_spec_decode``: vLLM refuses min_p and
  logit_bias under speculative decoding (its rejection sampler skips them); corelib applies
  every stage at every verification slot, so with ``CORELIB_VLLM`` set they are accepted;
- ``llvmlite.binding.ffi`` (loaded with numba: the cpu backend's kernels, vLLM's ngram
  drafter): its library object answers dunder names with AttributeError instead of a wrapped
  C symbol, so vLLM's CPU worker start, which reads ``vars()`` of every module-level value,
  can start a second engine in the process;
- ``vllm.v1.engine.core.EngineCore`` (``install_guard``, whether or not the variable is set
  when vLLM loads its plugins): an engine core started with ``CORELIB_VLLM`` set installs the
  hooks above if this process has not (the variable was set after vLLM loaded its plugins,
  which it does once per process), and before it sizes the KV cache asks every worker which
  sampler its runner has (``worker_sampler_report``), logs one line per worker and refuses to
  start when one would not sample with corelib, saying why.

Modules are patched when they are imported (or at once if they already are), so loading the
plugin imports nothing of vLLM's runner in processes that never build one. Each hook reads
``CORELIB_VLLM`` when it runs: a runner built while the variable is unset keeps vLLM's sampler.

The import hook is a ``sys.meta_path`` finder that stays in place and patches the module each
time its code runs (also after a failed import or a reload). It never removes itself: Python
iterates ``sys.meta_path`` without a copy and releases the import lock between finders, so a
finder that leaves the list while another thread imports shifts the list under that thread,
which then skips the next finder (and the module it would have patched).
"""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import logging
import os
import sys
from typing import Any, Callable

from . import ENV_VAR, backend_choice

# Under vLLM's logger, so the start-up lines go where vLLM's own go, formatted and filtered as
# vLLM's logging configuration says (it configures the "vllm" logger only).
logger = logging.getLogger("vllm.corelib")

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
INPUT_BATCH_MODULE = "vllm.v1.worker.gpu_input_batch"
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
PARALLEL_SAMPLING_MODULE = "vllm.v1.engine.parallel_sampling"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SAMPLING_PARAMS_MODULE = "vllm.sampling_params"
PROPOSER_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
LLVMLITE_FFI_MODULE = "llvmlite.binding.ffi"
# The attribute of a ModelRunnerOutput that carries the step's flagged requests (request id ->
# why) from the worker to the scheduler; it travels with the output (pickled between processes).
FAILURES_ATTRIBUTE = "corelib_failures"
# Set on every function corelib puts in place of vLLM's, so a check can tell a patched class.
HOOK_MARK = "__corelib_hook__"

_installed = False
_guarded = False


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
    when_imported(INPUT_BATCH_MODULE, _patch_input_batch)
    when_imported(INPUT_PROCESSOR_MODULE, _patch_input_processor)
    when_imported(PARALLEL_SAMPLING_MODULE, _patch_parallel_sampling)
    when_imported(SCHEDULER_MODULE, _patch_scheduler)
    when_imported(SAMPLING_PARAMS_MODULE, _patch_spec_decode_validation)
    when_imported(PROPOSER_MODULE, _patch_proposer)
    when_imported(LLVMLITE_FFI_MODULE, _patch_llvmlite_library)
    install_guard()


def install_guard() -> None:
    """Install the engine core's start-up hooks (once per process; inert while
    ``CORELIB_VLLM`` is unset when an engine starts)."""
    global _guarded
    if _guarded:
        return
    _guarded = True
    when_imported(ENGINE_CORE_MODULE, _patch_engine_core)


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
    routed = routed_apply_grammar_bitmask(module.apply_grammar_bitmask, sampler_for)
    setattr(routed, HOOK_MARK, True)
    module.apply_grammar_bitmask = routed


def _patch_input_batch(module) -> None:
    from .sampler import sampler_for

    def without_generator(batch, row):
        if sampler_for(batch) is not None:
            batch.generators.pop(row, None)
        return row
    _wrap_result(module.InputBatch, "add_request", without_generator)


def attach_sampler(runner: Any, choice: str) -> None:
    """Give ``runner`` (a V1 ``GPUModelRunner``) corelib's sampler (and corelib's draft
    verification when it decodes speculatively), or raise ValueError naming the engine
    setting corelib cannot honour (``CorelibSampler`` checks them)."""
    from .sampler import CorelibSampler
    runner.sampler = CorelibSampler(runner, choice)
    if runner.speculative_config is not None:
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

    from .params import corelib_params, thinking_markers

    def after_process(processor, request):
        params = request.sampling_params
        if backend_choice() is None or params is None:
            return
        vocab_size = processor.model_config.get_vocab_size()
        try:
            thinking = (None if params.thinking_token_budget is None else
                        thinking_markers(processor.vllm_config.reasoning_config, vocab_size))
            corelib_params(params, vocab_size, thinking=thinking)
        except ValueError as exc:
            raise VLLMValidationError(f"corelib sampler ({ENV_VAR}): {exc}") from exc
    _wrap_after(module.InputProcessor, "process_inputs", after_process)


def _patch_parallel_sampling(module) -> None:
    from .params import child_params

    def corelib_children(original, parent, index):
        if backend_choice() is None or parent.sampling_params.seed is None:
            return original(parent, index)     # unseeded children share vLLM's cached params
        return child_params(parent.sampling_params, index)
    _wrap_around(module.ParentRequest, "_get_child_sampling_params", corelib_children)


def _patch_engine_core(module) -> None:
    def install_if_asked(core, *args, **kwargs):
        if backend_choice() is not None:
            install()        # no-op unless CORELIB_VLLM was set after the plugins loaded
    _wrap_before(module.EngineCore, "__init__", install_if_asked)

    def check_before_kv_cache(core, *args, **kwargs):
        if backend_choice() is not None:
            check_workers(core.model_executor)
    _wrap_before(module.EngineCore, "_initialize_kv_caches", check_before_kv_cache)


def check_workers(executor: Any) -> list[dict[str, Any]]:
    """Ask every worker of ``executor`` which sampler its runner has; log one line per worker
    and raise RuntimeError, saying why, when one would not sample with corelib."""
    reports = executor.collective_rpc(worker_sampler_report)
    for report in reports:
        if "problem" not in report:
            logger.info("corelib sampler (%s): %s samples with corelib backend %r on %s; "
                        "patched: %s", ENV_VAR, report["worker"], report["backend"],
                        report["device"], ", ".join(report["patched"]))
    problems = [report["problem"] for report in reports if "problem" in report]
    if problems:
        raise RuntimeError(f"{ENV_VAR}={backend_choice()!r} is set, but this engine would not "
                           f"sample with corelib: " + "; ".join(problems))
    return reports


def worker_sampler_report(worker: Any) -> dict[str, Any]:
    """Runs in a worker process (``collective_rpc``): ``worker`` (where, "worker rank r (pid
    p)") and either ``backend``, ``device`` and ``patched`` (what corelib replaced in this
    worker) or ``problem`` (why its runner would not sample with corelib)."""
    where = f"worker rank {getattr(worker, 'rank', '?')} (pid {os.getpid()})"
    runner = getattr(worker, "model_runner", None)
    problem = why_not_corelib(runner)
    if problem is not None:
        return {"worker": where, "problem": f"{where}: {problem}"}
    report = {"worker": where, **runner.sampler.describe()}
    batch_module = sys.modules.get(INPUT_BATCH_MODULE)
    if batch_module is not None and _is_hook(batch_module.InputBatch.add_request):
        report["patched"].append("no per-request generators")
    if _is_hook(type(runner).sample_tokens):
        report["patched"].append("flagged rows -> scheduler")
    return report


def why_not_corelib(runner: Any) -> str | None:
    """Why ``runner`` (a worker's model runner) would not sample with corelib, or None."""
    choice = backend_choice()
    if choice is None:
        return f"{ENV_VAR} is not set in this process; every vLLM process must inherit it"
    if runner is None:
        return "the worker has no model runner"
    if not _installed:
        return (f"corelib's hooks are not installed in this process: vLLM did not load the "
                f"'corelib' plugin here (VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r} must "
                f"name it when set)")
    from .sampler import CorelibSampler
    sampler = getattr(runner, "sampler", None)
    if isinstance(sampler, CorelibSampler):
        return None
    v1 = sys.modules.get(V1_RUNNER_MODULE)
    if v1 is None or not isinstance(runner, v1.GPUModelRunner):
        return (f"its model runner is {_qualified(type(runner))}, not vLLM's V1 runner, the "
                f"one corelib samples in")
    if not _is_hook(v1.GPUModelRunner.__dict__["__init__"]):
        return (f"vLLM's V1 runner module was imported without corelib's hook (another import "
                f"hook loaded it first), so its runner keeps vLLM's sampler")
    return (f"its runner's sampler is {_qualified(type(sampler))}: the runner was built "
            f"while {ENV_VAR} was unset, or something replaced corelib's sampler after")


def _qualified(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _patch_llvmlite_library(module) -> None:
    """llvmlite's library object (``llvmlite.binding.ffi.lib``, loaded with numba: by the cpu
    backend's kernels, by vLLM's ngram drafter) answers every attribute it lacks with a wrapped
    C symbol of the library, ``__dict__`` included. vLLM's CPU worker start scans the namespace
    of every loaded module and reads ``vars()`` of each value, which then fails on that object:
    no second engine could start in a process that loaded numba. Afterwards the object answers
    dunder names as a plain object without them does (AttributeError): the library has no C
    symbol of that form, so nothing llvmlite or numba looks up changes."""
    library = module._lib_wrapper
    if _is_hook(library.__getattr__):
        return
    symbol = library.__getattr__

    def getattr_without_dunders(lib, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"{type(lib).__name__!r} object has no attribute {name!r}")
        return symbol(lib, name)
    _install(library, "__getattr__", functools.wraps(symbol)(getattr_without_dunders))


def _patch_proposer(module) -> None:
    from .speculative import BLOCK_REJECTION

    def probabilities_for_block_verification(proposer, result):
        spec = proposer.speculative_config
        if (backend_choice() is not None and spec.rejection_sample_method == BLOCK_REJECTION
                and spec.draft_sample_method == "probabilistic"):
            proposer._enable_probabilistic_draft_probs = True
    _wrap_after(module.SpecDecodeBaseProposer, "__init__", probabilities_for_block_verification)


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
    _install(cls, name, wrapper)


def _wrap_result(cls: type, name: str, transform: Callable) -> None:
    """``cls.name``, its result replaced by ``transform(self, result)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return transform(self, original(self, *args, **kwargs))
    _install(cls, name, wrapper)


def _wrap_around(cls: type, name: str, hook: Callable) -> None:
    """``hook(original, self, *args, **kwargs)`` in place of ``cls.name``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)
    _install(cls, name, wrapper)


def _wrap_before(cls: type, name: str, hook: Callable) -> None:
    """``hook(self, *args, **kwargs)`` then ``cls.name``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        hook(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    _install(cls, name, wrapper)


def _install(cls: type, name: str, wrapper: Callable) -> None:
    setattr(wrapper, HOOK_MARK, True)
    setattr(cls, name, wrapper)


def _is_hook(function: Any) -> bool:
    return getattr(function, HOOK_MARK, False)


def when_imported(module_name: str, patch: Callable[[Any], None]) -> None:
    """Call ``patch(module)`` now if ``module_name`` is imported, and each time its code runs
    from now on (an import hook that stays in ``sys.meta_path``; see the module docstring)."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


class _PatchOnImport:
    """A ``sys.meta_path`` finder for one module: finds it as the path finder would, and runs
    ``patch`` after the module's own code, every time that code runs."""

    def __init__(self, module_name: str, patch: Callable[[Any], None]):
        self.module_name = module_name
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name != self.module_name:
            return None
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
