"""The stages' row sums on the cuda backend (``corelib_cuda.row_sum``, the core's
``Sampler.row_sum`` hook): the Triton kernel run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, in a subprocess so the mode applies from Triton's import on). A row's
sum must have the same bits alone, among 8 or 40 rows, beside other rows and as a strided
view; stay within the stated bound of the exact sum and of torch's; and inside
``CudaSampler`` (and the graph runner's eager replay) keep ``score`` over positions bitwise
equal to one step at a time, and the reference's seeded tokens and kept sets. Without the
kernel a row sum whose bits move with the row count (as torch's CUDA sum's do) breaks that
``score`` rule, which is checked here on CPU. On a GPU, ``test_gpu.py`` checks the start-up
launch, the same bits on CUDA tensors and a graph capture."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from corelib.reductions import torch_row_sum
from corelib.testing import ConformanceSuite

from corelib_cuda import CudaSampler
from corelib_cuda.bitmask import triton_import_error
from corelib_cuda.row_sum import RowSumPath, choose_row_sum_path, launch_checked, row_sum_op

TRITON = triton_import_error()
needs_triton = pytest.mark.skipif(TRITON is not None, reason=f"triton unavailable: {TRITON}")

KERNEL_BITS = textwrap.dedent("""
    import torch
    from corelib_cuda.row_sum import BLOCK, error_bound, launch_checked, triton_row_sum

    def bits(t):
        return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)

    def stage_rows(V, gen):
        # rows as the stages hand them over: plain values, zeros, -inf entries, p log p with
        # exact zeros where p is 0, finite logits with 0 for -inf, squared deviations, a tail
        x = torch.randn((40, V), generator=gen) * 3
        x[1] = 0.0
        x[2, ::5] = float("-inf")
        logits = x[3].clone()
        logits[: V // 3] = float("-inf")
        logp = torch.log_softmax(logits * 4, dim=-1)
        p = logp.exp()
        x[3] = torch.where(p > 0, p * logp, 0.0)
        x[4] = torch.where(torch.isfinite(logits), logits, 0.0)
        x[5] = (x[5] - x[5].mean()) ** 2
        x[6, V // 2:] = 0.0
        x[7] = p * p
        return x

    gen = torch.Generator().manual_seed(4)
    checked = 0
    for V in (1, 31, 2047, 2048, 2049, 6000, 128256):
        base = stage_rows(V, gen)
        for dtype in (torch.float32, torch.float64):
            x = base.to(dtype)
            whole = triton_row_sum(x)
            assert whole.shape == (40,) and whole.dtype == dtype, (whole.shape, whole.dtype)
            # other rows, in another order, with the same rows placed elsewhere
            others = (torch.randn((40, V), generator=gen) * 7).to(dtype)
            perm = torch.randperm(40, generator=gen)
            others[perm[:8]] = x[:8]
            among_others = triton_row_sum(others)[perm[:8]]
            strided = torch.zeros((8, 3, V), dtype=dtype)
            strided[:, 1] = x[:8]
            as_view = triton_row_sum(strided[:, 1])
            for i in range(8):
                alone = triton_row_sum(x[i:i + 1])
                eight = triton_row_sum(x[max(0, i - 3):max(0, i - 3) + 8])[i - max(0, i - 3)]
                for got in (alone[0], eight, among_others[i], as_view[i]):
                    assert torch.equal(bits(got), bits(whole[i])), (V, dtype, i, float(got), float(whole[i]))
                checked += 1
            # within the bound of the exact sum, and so within twice of torch's
            exact = x.double().sum(dim=-1)
            finite = torch.isfinite(exact)
            assert torch.equal(torch.isfinite(whole), finite), (V, dtype)
            bound = error_bound(x)
            off = (whole.double() - exact).abs()
            assert bool((off[finite] <= bound[finite]).all()), (V, dtype, float((off - bound)[finite].max()))
            torch_off = (whole.double() - x.sum(dim=-1).double()).abs()
            assert bool((torch_off[finite] <= 2 * bound[finite]).all()), (V, dtype)
            assert torch.equal(whole[~finite], exact[~finite].to(dtype)), (V, dtype)
    path = launch_checked(torch.device("cpu"), triton_row_sum)
    assert path.description == "triton", path.description
    print("ok", checked)
""")

IN_A_SAMPLER = textwrap.dedent("""
    import torch
    from corelib import Sampler, SamplingParams
    from corelib.testing import ConformanceSuite
    from corelib.testing.cases import STAGE_CASES
    from corelib_cuda import CudaSampler, GraphedSampler
    from corelib_cuda.row_sum import RowSumPath, triton_row_sum

    launches = []

    def counted(values):
        launches.append(tuple(values.shape))
        return triton_row_sum(values)

    def forced():
        s = CudaSampler("cpu", use_flashinfer=False)
        s.sums = RowSumPath(counted, "triton")
        return s

    suite = ConformanceSuite()
    suite.backend = "cuda"
    reference = Sampler("cpu")
    sampler = forced()
    assert sampler.row_sum_path == "triton"
    # the rule the GPU run broke (40 virtual rows against 8), with the kernel's sums
    suite.test_score_over_positions_equals_single_steps_with_append(sampler)
    assert any(shape[0] == 40 for shape in launches) and any(shape[0] == 8 for shape in launches), launches
    for composition in ("same", "reversed", "with_others"):
        suite.test_score_equals_the_processed_logprob_sample_reported(sampler, composition)
    # the reference's kept sets and seeded tokens where every stage with a row sum runs
    for case in sorted(STAGE_CASES):
        suite.test_kept_set_matches_reference(sampler, reference, case)
    suite.test_seeded_tokens_equal_the_reference(sampler, reference)
    suite.test_score_is_differentiable(sampler, reference)

    V = 300
    rows = [SamplingParams(dynatemp_range=0.5, seed=1), SamplingParams(top_n_sigma=1.0, seed=2),
            SamplingParams(eta_cutoff=0.01, seed=3), SamplingParams(p_less="norm", seed=4),
            SamplingParams(typical_p=0.7, seed=5), SamplingParams(tfs=0.9, seed=6),
            SamplingParams(typical_p=0.8, tfs=0.95, top_k=20, seed=7),
            SamplingParams(mirostat_tau=3.0, mirostat_eta=0.4, seed=8)]
    runs = {}
    for name, make in (("reference", lambda: Sampler("cpu")), ("triton", forced),
                       ("graph", lambda: GraphedSampler(forced(), sizes=(8,), use_graphs=False))):
        s = make()
        batch = s.new_batch(V, logprobs_mode="processed")
        for i, params in enumerate(rows):
            batch.add(f"r{i}", params.model_copy(update={"logprobs": 0}), prompt_token_ids=[1, 2])
        tokens, logprobs = [], []
        for step in range(4):
            logits = torch.randn((len(rows), V), generator=torch.Generator().manual_seed(step)) * 3
            out = s.sample(logits, batch)
            batch.append(out.token_ids)
            tokens.append(out.token_ids.tolist())
            logprobs.append(out.logprobs.logprobs[:, 0])
        runs[name] = tokens, torch.stack(logprobs)
    for name in ("triton", "graph"):
        assert runs[name][0] == runs["reference"][0], (name, runs[name][0], runs["reference"][0])
        assert torch.allclose(runs[name][1], runs["reference"][1], rtol=0, atol=1e-5), name
    assert torch.equal(runs["graph"][1], runs["triton"][1])
    print("ok", len(launches))
""")


def run_interpreted(script: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@needs_triton
def test_a_rows_sum_has_the_same_bits_in_any_tensor_and_is_within_the_bound():
    out = run_interpreted(KERNEL_BITS)
    assert out.strip().startswith("ok"), out


@needs_triton
def test_the_kernels_sums_keep_score_bitwise_and_the_references_tokens():
    out = run_interpreted(IN_A_SAMPLER)
    assert out.strip().startswith("ok"), out


class RowCountSums(CudaSampler):
    """torch's sum moved by a few units in its last place on tensors of more than 8 rows: a
    row sum whose bits depend on the row count, as torch's CUDA reduction's may."""

    def row_sum(self, values, keepdim=False):
        out = torch_row_sum(values, keepdim=keepdim)
        return out * (1 + 8 * torch.finfo(out.dtype).eps) if values.shape[0] > 8 else out


def test_a_row_sum_that_moves_with_the_row_count_breaks_score_over_positions():
    suite = ConformanceSuite()
    suite.backend = "cuda"
    with pytest.raises(pytest.fail.Exception, match="one step at a time with append between"):
        suite.test_score_over_positions_equals_single_steps_with_append(
            RowCountSums("cpu", use_flashinfer=False))
    # the same suite passes with torch's CPU sum, whose bits depend on the row alone
    suite.test_score_over_positions_equals_single_steps_with_append(CudaSampler("cpu", use_flashinfer=False))


def test_off_cuda_the_row_sum_is_torchs():
    path = choose_row_sum_path("cpu")
    assert path.kernel is None and path.description.startswith("torch (the device is cpu")
    sampler = CudaSampler("cpu", use_flashinfer=False)
    assert sampler.row_sum_path == path.description
    x = torch.randn((5, 70), generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampler.row_sum(x, keepdim=True), x.sum(dim=-1, keepdim=True))


def test_the_custom_operation_is_torchs_sum_on_cpu_a_shape_on_meta_and_differentiable():
    x = torch.randn((5, 700), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(row_sum_op(x), x.sum(dim=-1))
    out = row_sum_op(x.to("meta"))
    assert out.shape == (5,) and out.dtype == torch.float64
    x.requires_grad_()
    weights = torch.arange(5, dtype=torch.float64)
    (row_sum_op(x) * weights).sum().backward()
    assert torch.equal(x.grad, weights[:, None].expand(5, 700))


def test_the_path_sums_any_leading_shape_keeps_dims_and_copies_strided_rows():
    seen = []

    def kernel(values):
        seen.append((tuple(values.shape), values.stride(-1)))
        return values.sum(dim=-1)

    path = RowSumPath(kernel, "triton")
    x = torch.randn((2, 3, 50), generator=torch.Generator().manual_seed(2))
    assert torch.equal(path.sum(x), x.sum(dim=-1))
    assert torch.equal(path.sum(x, keepdim=True), x.sum(dim=-1, keepdim=True))
    assert torch.equal(path.sum(x.transpose(0, 2)), x.transpose(0, 2).sum(dim=-1))
    assert seen == [((6, 50), 1), ((6, 50), 1), ((150, 2), 1)]
    ints = torch.ones((2, 4), dtype=torch.int64)
    assert torch.equal(path.sum(ints), ints.sum(dim=-1)) and len(seen) == 3     # torch's


def test_a_row_sum_that_fails_its_launch_check_leaves_torchs_sum():
    moving = launch_checked(torch.device("cpu"),
                            lambda v: v.sum(dim=-1) + (1e-3 if v.shape[0] > 8 else 0.0))
    assert moving.kernel is None and "changed with the row count" in moving.description
    off = launch_checked(torch.device("cpu"), lambda v: v.sum(dim=-1) * 1.001)
    assert off.kernel is None and "more than the error bound" in off.description
    broken = launch_checked(torch.device("cpu"), lambda v: 1 / 0)
    assert broken.kernel is None and "ZeroDivisionError" in broken.description
    assert launch_checked(torch.device("cpu"), lambda v: v.sum(dim=-1)).description == "triton"
