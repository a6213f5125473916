"""Around a vLLM 0.32 CPU-build limit that matters to processes starting several engines (the
test suite, the throughput benchmark), shared by both.

vLLM's CPU worker start rebinds Triton kernels to C++ replacements by scanning the namespace of
every module in ``sys.modules`` and reading ``vars()`` of each value. llvmlite's library
wrapper (``llvmlite.binding.ffi.lib``, imported with numba by vLLM's ngram drafter) answers
``vars()`` with a function wrapper, and the scan raises: once an engine with ngram speculation
started, no other engine starts in that process.
"""

from __future__ import annotations

import sys

LLVMLITE_FFI = "llvmlite.binding.ffi"


def allow_engines_after_ngram() -> None:
    """Run vLLM's kernel scan with llvmlite's ffi module out of ``sys.modules`` (the scan
    imports nothing meanwhile; the module is back right after). Idempotent."""
    from vllm.platforms.cpu import CpuPlatform
    register = CpuPlatform.register_triton_kernel_overrides
    if getattr(register, "without_llvmlite", False):
        return

    def register_without_llvmlite(cls):
        hidden = sys.modules.pop(LLVMLITE_FFI, None)
        try:
            register()
        finally:
            if hidden is not None:
                sys.modules[LLVMLITE_FFI] = hidden
    register_without_llvmlite.without_llvmlite = True
    CpuPlatform.register_triton_kernel_overrides = classmethod(register_without_llvmlite)
