"""corelib as vLLM's sampler.

vLLM calls ``register`` in every process it starts (the API front end, the engine core, each
worker), through the ``vllm.general_plugins`` entry point that corelib's distribution
declares. Nothing changes unless the environment variable ``CORELIB_VLLM`` is set, to a
backend name (``cpu``, ``cuda``, ``reference``, any installed backend) or to ``auto``
(``corelib.get_sampler``'s platform detection on the worker's device). With it set:

- vLLM's V1 model runner (``GPUModelRunner`` and the CPU and XPU runners built on it) samples
  with a ``CorelibSampler`` instead of vLLM's ``Sampler``, in every worker process;
- each request's vLLM ``SamplingParams`` become ``corelib.SamplingParams`` when vLLM admits
  the request, so a parameter corelib cannot honour fails that request with vLLM's own
  validation error (HTTP 400 in the server) instead of sampling differently;
- each engine checks at start that every worker samples with corelib, and refuses to start
  when one would not.

The pieces: ``params`` (the parameter mapping), ``sampler`` (the sampler and the corelib
batch that follows vLLM's persistent batch), ``processors`` (vLLM's logits processors as
corelib stages), ``patches`` (where vLLM is hooked). vLLM's modules are patched when they are
imported; nothing of vLLM is imported by loading the plugin.
"""

from __future__ import annotations

import os

ENV_VAR = "CORELIB_VLLM"
AUTO = "auto"

__all__ = ["AUTO", "ENV_VAR", "backend_choice", "register"]


def backend_choice() -> str | None:
    """The value of ``CORELIB_VLLM`` (stripped), or None when it is unset or empty."""
    choice = os.environ.get(ENV_VAR, "").strip()
    return choice or None


def register() -> None:
    """vLLM's general-plugin hook (idempotent: vLLM may call it more than once per process).
    With ``CORELIB_VLLM`` set, installs the hooks. Without it, installs only the engine start
    check, which does nothing unless the variable is set by the time an engine starts (vLLM
    loads its plugins once per process, so the variable may come later)."""
    from .patches import install, install_guard
    if backend_choice() is None:
        install_guard()
    else:
        install()
