"""Step 3's token bitmask kernel: the Triton kernel the GPU runs, executed on CPU tensors by
Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess so the mode applies from
Triton's import on), against the torch expression and the reference's unpacking. On a GPU the
same comparison runs on CUDA tensors (skipped here)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from corelib.bitmask import pack_bitmask, unpack_bitmask

from corelib_cuda.bitmask import (apply_token_bitmask_, torch_apply_token_bitmask_,
                                  triton_import_error)
from corelib_cuda.probe import cuda_availability

TRITON = triton_import_error()
needs_triton = pytest.mark.skipif(TRITON is not None, reason=f"triton unavailable: {TRITON}")
GPU = cuda_availability()

CASES = textwrap.dedent("""
    import torch
    from corelib.bitmask import pack_bitmask, unpack_bitmask

    def cases(device):
        # V around word and block edges; empty, full and unconstrained (-1) rows; bits past V set
        for V, rows in ((1, 2), (31, 3), (32, 3), (33, 4), (1023, 2), (1025, 3), (4000, 5)):
            gen = torch.Generator().manual_seed(V)
            allowed = torch.rand((rows, V), generator=gen) < 0.35
            allowed[0] = False
            allowed[1] = True
            words = pack_bitmask(allowed)
            words[-1] = -1
            x = torch.randn((rows, V), generator=gen)
            x[0, 0] = float("-inf")
            yield V, x.to(device), words.to(device), unpack_bitmask(words, V).to(device)
""")


def check(kernel_name: str, device: str) -> str:
    return CASES + textwrap.dedent(f"""
        from corelib_cuda.bitmask import {kernel_name} as kernel
        for V, x, words, allowed in cases({device!r}):
            got = kernel(x.clone(), words)
            want = x.masked_fill(~allowed, float("-inf"))
            assert torch.equal(got, want), f"V={{V}}"
        # a strided row view (the verify path's [B (K+1), V] rows are contiguous, but the
        # kernel takes any row stride)
        x = torch.randn((4, 70), device={device!r})
        words = pack_bitmask(torch.rand((4, 64)) < 0.5).to({device!r})
        view = x[:, 3:67]
        kernel(view, words)
        assert torch.equal(torch.isinf(x[:, 3:67]).cpu(), ~unpack_bitmask(words.cpu(), 64))
        assert not torch.isinf(x[:, :3]).any() and not torch.isinf(x[:, 67:]).any()
        print("ok")
    """)


@needs_triton
def test_triton_kernel_in_the_interpreter_matches_the_reference_unpacking():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", check("triton_apply_token_bitmask_", "cpu")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_torch_fallback_matches_the_reference_unpacking():
    namespace: dict = {}
    exec(CASES, namespace)
    for V, x, words, allowed in namespace["cases"]("cpu"):
        expected = x.masked_fill(~allowed, float("-inf"))
        assert torch.equal(torch_apply_token_bitmask_(x.clone(), words), expected), V
        assert torch.equal(apply_token_bitmask_(x.clone(), words), expected), V   # CPU: torch


@pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")
@needs_triton
def test_triton_kernel_on_the_gpu_matches_the_reference_unpacking():
    namespace: dict = {}
    exec(check("apply_token_bitmask_", "cuda"), namespace)   # the sampler's entry point


def test_pack_and_unpack_agree_with_the_kernel_format():
    allowed = torch.zeros((1, 70), dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    words = pack_bitmask(allowed)
    assert words.dtype == torch.int32 and words.shape == (1, 3)
    assert words[0, 0] == (1 | (1 << 31)) - (1 << 32)        # bits 0 and 31: a negative int32
    assert torch.equal(unpack_bitmask(words, 70), allowed)
