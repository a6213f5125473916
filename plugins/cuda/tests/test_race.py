"""Step 14's seeded race as one Triton kernel (``corelib_cuda.race``): run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, in a subprocess so the mode applies from
Triton's import on), against the torch expression of the contract's noise, alone and inside
``CudaSampler`` and the graph runner's eager replay. On a GPU the start-up launch check and
the same comparison run on CUDA tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from corelib_cuda.bitmask import triton_import_error
from corelib_cuda.probe import cuda_availability
from corelib_cuda.race import RacePath, choose_race_path, seeded_race, torch_seeded_race

TRITON = triton_import_error()
needs_triton = pytest.mark.skipif(TRITON is not None, reason=f"triton unavailable: {TRITON}")
GPU = cuda_availability()

IN_A_STEP = textwrap.dedent("""
    import torch
    from corelib import Sampler, SamplingParams
    from corelib_cuda import CudaSampler, GraphedSampler
    from corelib_cuda.race import launch_checked, triton_seeded_race, torch_seeded_race

    # the kernel alone: block edges, a partial last block, -inf rows and tails, ties
    gen = torch.Generator().manual_seed(3)
    for V in (1, 31, 2047, 2048, 2049, 6000):
        x = torch.randn((40, V), generator=gen) * 3
        x[3] = float("-inf")
        x[5, : V // 2] = float("-inf")
        x[7] = torch.round(x[7])
        keys = torch.randint(-2**31, 2**31 - 1, (40,), generator=gen, dtype=torch.int64).to(torch.int32)
        assert torch.equal(triton_seeded_race(x, keys), torch_seeded_race(x, keys)), V

    path = launch_checked(torch.device("cpu"), triton_seeded_race)
    assert path.description == "triton", path.description
    launches = []

    def counted(x, keys):
        launches.append(tuple(x.shape))
        return triton_seeded_race(x, keys)

    V, K = 3000, 3
    def sampler(triton):
        s = CudaSampler("cpu", use_flashinfer=False)
        if triton:
            s.race = type(path)(counted, "triton")
        return s

    def batch_of(s):
        batch = s.new_batch(V)
        batch.add("a", SamplingParams(seed=3, top_k=40, top_p=0.9, temperature=0.8), prompt_token_ids=[1, 2])
        batch.add("b", SamplingParams(seed=4, n=2, top_p=0.8, repetition_penalty=1.2), prompt_token_ids=[5])
        batch.add("c", SamplingParams(seed=5, temperature=1.3))
        return batch

    def logits(rows, seed):
        return torch.randn((rows, V), generator=torch.Generator().manual_seed(seed)) * 3

    runs = {}
    for name, make in (("reference", lambda: Sampler("cpu")), ("torch", lambda: sampler(False)),
                       ("triton", lambda: sampler(True)),
                       ("graph", lambda: GraphedSampler(sampler(True), sizes=(4, 8), use_graphs=False))):
        s = make()
        batch = batch_of(s)
        tokens = []
        for step in range(3):
            out = s.sample(logits(4, step), batch)
            batch.append(out.token_ids)
            tokens.append(out.token_ids.tolist())
        drafts = torch.randint(V, (4, K), generator=torch.Generator().manual_seed(9))
        out = s.verify(logits(4 * (K + 1), 10).view(4, K + 1, V), batch, drafts)
        tokens.append(out.token_ids.tolist())
        runs[name] = tokens
    for name in ("torch", "triton", "graph"):
        assert runs[name] == runs["reference"], (name, runs[name], runs["reference"])
    assert launches[:4] == [(4, V)] * 3 + [(4 * (K + 1), V)], launches
    assert len(launches) == 8, launches
    print("ok")
""")


@needs_triton
def test_the_triton_race_gives_the_references_seeded_tokens_alone_and_inside_a_step():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", IN_A_STEP], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok"), result.stdout


def test_off_cuda_the_race_is_the_torch_expression():
    path = choose_race_path("cpu")
    assert path.race is torch_seeded_race and path.description.startswith("torch (the device is cpu")


def test_the_custom_operation_is_the_torch_expression_on_cpu_and_a_shape_on_meta():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((5, 700), generator=gen)
    keys = torch.randint(-2**31, 2**31 - 1, (5,), generator=gen, dtype=torch.int64).to(torch.int32)
    assert torch.equal(seeded_race(x, keys), torch_seeded_race(x, keys))
    out = seeded_race(x.to("meta"), keys.to("meta"))
    assert out.shape == (5,) and out.dtype == torch.long


def test_a_race_that_fails_its_launch_check_leaves_the_torch_expression():
    from corelib_cuda.race import launch_checked
    wrong = launch_checked(torch.device("cpu"), lambda x, keys: torch.zeros(len(x), dtype=torch.long))
    assert wrong.race is torch_seeded_race and "picked other tokens" in wrong.description
    broken = launch_checked(torch.device("cpu"), lambda x, keys: 1 / 0)
    assert broken.race is torch_seeded_race and "ZeroDivisionError" in broken.description


@pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")
@needs_triton
def test_the_race_runs_the_triton_kernel_on_the_gpu():
    path = choose_race_path("cuda")
    assert path.description == "triton", path.description
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((64, 128256), generator=gen) * 3
    keys = torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int64).to(torch.int32)
    got = path.draw(x.cuda(), keys.cuda()).cpu()
    assert torch.equal(got, torch_seeded_race(x.cuda(), keys.cuda()).cpu())
