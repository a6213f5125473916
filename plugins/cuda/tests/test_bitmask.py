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

from corelib import Sampler, SamplingParams

from corelib_cuda import CudaSampler
from corelib_cuda.bitmask import (BitmaskPath, apply_token_bitmask_, launch_checked,
                                  torch_apply_token_bitmask_, triton_import_error)
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
    """The kernel itself, then the start-up launch check on it: a good kernel passes it."""
    code = check("triton_apply_token_bitmask_", "cpu") + textwrap.dedent("""
        import torch
        from corelib_cuda.bitmask import _build_triton_kernel, launch_checked
        print(launch_checked(torch.device("cpu"), _build_triton_kernel).description)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "triton"]


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


# ---------------------------------------------------------------------------- start-up launch
def failing_launcher(x, words):
    """What a slim image gives on first use: Triton cannot build its launcher."""
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


def no_triton():
    raise ImportError("No module named 'triton'")


def masked_step(sampler, words):
    requests = [(f"s{i}", SamplingParams(seed=i, top_k=20)) for i in range(3)]
    batch = sampler.new_batch(words.shape[1] * 32 - 6)
    for rid, params in requests:
        batch.add(rid, params)
    logits = torch.randn((3, batch.vocab_size), generator=torch.Generator().manual_seed(4))
    return sampler.sample(logits, batch, token_bitmask=words), (logits, requests)


@pytest.mark.parametrize("build, says", [
    (lambda: failing_launcher, "the Triton kernel failed its first launch: RuntimeError: Failed to find C compiler"),
    (lambda: (lambda x, words: x), "the Triton kernel failed its first launch: it masked other tokens"),
    (lambda: no_triton(), "triton failed to import: ImportError: No module named 'triton'"),
], ids=["no_compiler", "wrong_tokens", "no_triton"])
def test_a_kernel_that_fails_at_start_up_leaves_the_torch_expression(build, says):
    """The launch check at start-up, not the first masked step, finds a kernel that cannot
    run: the device keeps the torch expression, steps with a mask run, the reason is shown."""
    path = launch_checked(torch.device("cpu"), build)
    assert path.kernel is None and path.description.startswith(f"torch ({says}")
    sampler = CudaSampler("cpu", use_flashinfer=False)
    sampler.bitmask = path
    words = pack_bitmask(torch.rand((3, 250), generator=torch.Generator().manual_seed(5)) < 0.4)
    out, (logits, requests) = masked_step(sampler, words)
    reference = Sampler("cpu")
    batch = reference.new_batch(250)
    for rid, params in requests:
        batch.add(rid, params)
    assert torch.equal(out.token_ids, reference.sample(logits, batch, token_bitmask=words).token_ids)
    assert sampler.bitmask_path.startswith(f"torch ({says}")


def test_a_kernel_that_passes_the_launch_check_is_the_one_that_runs():
    """A launcher that writes the right tokens is kept and called by the masked step."""
    launches = []

    def recording(x, words):
        launches.append(tuple(x.shape))
        return torch_apply_token_bitmask_(x, words)

    path = launch_checked(torch.device("cpu"), lambda: recording)
    assert path == BitmaskPath(recording, "triton") and launches == [(2, 70)]
    sampler = CudaSampler("cpu", use_flashinfer=False)
    sampler.bitmask = path
    masked_step(sampler, pack_bitmask(torch.rand((3, 250)) < 0.4))
    assert launches[1:] == [(3, 250)]


# ---------------------------------------------------------------------------- inside a step
IN_A_STEP = textwrap.dedent("""
    import torch
    from corelib import SamplingParams
    from corelib.bitmask import pack_bitmask
    from corelib_cuda import CudaSampler, GraphedSampler
    from corelib_cuda.bitmask import _build_triton_kernel, launch_checked

    V, K = 1000, 3        # not a multiple of 32: the last word is partial
    launches = []
    path = launch_checked(torch.device("cpu"), _build_triton_kernel)
    assert path.description == "triton", path.description

    def counted(x, words):
        launches.append(tuple(x.shape))
        return path.kernel(x, words)

    def sampler(triton):
        s = CudaSampler("cpu", use_flashinfer=False)
        if triton:
            s.bitmask = type(path)(counted, "triton")
        return s

    def batch_of(s):
        batch = s.new_batch(V)
        batch.add("a", SamplingParams(seed=3, top_k=40, top_p=0.9, temperature=0.8), prompt_token_ids=[1, 2])
        batch.add("b", SamplingParams(seed=4, n=2, min_p=0.05, repetition_penalty=1.2), prompt_token_ids=[5])
        batch.add("g", SamplingParams(temperature=0.0))
        return batch

    def mask(rows, seed):
        gen = torch.Generator().manual_seed(seed)
        allowed = torch.rand((rows, V), generator=gen) < 0.3
        allowed[:, 7] = True            # every row keeps a token
        words = pack_bitmask(allowed)
        words[-1] = -1                  # an unconstrained row
        return words

    def logits(rows, seed):
        return torch.randn((rows, V), generator=torch.Generator().manual_seed(seed)) * 3

    runs = {}
    for name, make in (("torch", lambda: sampler(False)), ("triton", lambda: sampler(True)),
                       ("graph", lambda: GraphedSampler(sampler(True), sizes=(4, 8), use_graphs=False))):
        s = make()
        batch = batch_of(s)
        tokens = []
        for step in range(3):
            out = s.sample(logits(4, step), batch, token_bitmask=mask(4, step))
            batch.append(out.token_ids)
            tokens.append(out.token_ids.tolist())
        gen = torch.Generator().manual_seed(9)
        drafts = torch.randint(V, (4, K), generator=gen)
        probs = torch.softmax(torch.randn((4, K, V), generator=gen), dim=-1)
        spec = logits(4 * (K + 1), 10).view(4, K + 1, V)
        out = s.verify(spec, batch, drafts, probs, token_bitmask=mask(4 * (K + 1), 11).view(4, K + 1, -1))
        tokens.append(out.token_ids.tolist())
        runs[name] = tokens
    assert runs["triton"] == runs["torch"], (runs["triton"], runs["torch"])
    assert runs["graph"] == runs["torch"], (runs["graph"], runs["torch"])
    # sampler: 3 steps of 4 rows, a verify of 4 (K + 1) rows; the graph runner pads to 4 rows
    assert launches[:4] == [(4, V)] * 3 + [(4 * (K + 1), V)], launches
    assert launches[4:] == [(4, V)] * 3 + [(4 * (K + 1), V)], launches
    print("ok", runs["torch"][0])
""")


@needs_triton
def test_the_triton_kernel_inside_the_sampler_and_the_graph_runner_gives_the_torch_paths_tokens():
    """The kernel the GPU runs, called by step 3 of ``CudaSampler.sample``, ``verify`` and the
    graph runner's eager replay (CPU tensors, Triton's interpreter): seeded tokens, greedy ones
    and verification outcomes equal the torch expression's, and the kernel ran every time."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", IN_A_STEP], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout


# ---------------------------------------------------------------------------- kept sets
@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}"))])
def test_kept_words_are_the_cores_and_pack_without_host_data(device):
    """The core's ``pack_kept`` gives the same words on every device (bits past V clear) at
    word edges, and builds nothing from host data: the sync checker passes it on the meta
    device, which sees every upload."""
    from corelib.bitmask import pack_kept
    from corelib_cuda.sync_check import no_host_sync
    for V in (1, 31, 32, 33, 1023, 1025):
        keep = torch.rand((3, 2, V), generator=torch.Generator().manual_seed(V)) < 0.5
        keep[0] = True
        want = pack_kept(keep)
        on = keep.to(device)
        with no_host_sync(device if device == "cuda" else None):
            got = pack_kept(on)
        assert got.shape == want.shape and got.dtype == torch.int32
        if device != "meta":
            assert torch.equal(got.cpu(), want), f"V = {V}"
            assert torch.equal(unpack_bitmask(got.cpu(), V), keep)
