"""What a step moves: bytes read and written, and passes over ``[B, V]``-sized tensors, counted
per aten operation by a ``TorchDispatchMode`` (on meta tensors, so the real vocabulary costs
no memory and no time), for the cuda backend's torch path and its graph runner.

    python -m corelib_cuda.traffic                      # the table: B 1, 32, 128; V 128256; K 0, 4
    python -m corelib_cuda.traffic --batch-sizes 1 --ks 4 --configs seeded --ops   # one case, per op
    python -m corelib_cuda.traffic --batch-sizes 32 --configs top-k+top-p,+tfs,+eta   # one new sampler each

An operation is counted as the kernel a GPU would run for it: views, reshapes and metadata
calls move nothing and are not counted; every other operation reads each tensor argument
(its distinct elements: a broadcast ``[B, 1]`` read as ``[B, V]`` counts B elements) and writes
each output, or the arguments it mutates (``out=`` and in-place operations). A pass over
``[B, V]`` is an operation that reads or writes at least ``B * V`` distinct elements (a gather reads
one element per index, an in-place scatter writes one per index), where B is
the number of requests: a verify step's ``[B (K + 1), V]`` operations count one pass each, as
a step's ``[B, V]`` ones do. ``sorts`` counts sorts (``sort``, ``argsort``, ``topk`` with k
above a quarter of the row) over rows of the vocabulary's length.

The graph runner is counted in its eager form (``use_graphs=False``): the same operations a
CUDA graph would replay, plus the copies into its static buffers. Kernels outside aten (the
Triton bitmask and seeded-race kernels, FlashInfer's) are counted through their custom
operations where they have one: on meta tensors the sampler takes the seeded race's custom
operation, as it does on a CUDA device where the kernel passed its start-up launch, so the
table counts the steps a GPU runs (on CPU tensors the race is the torch expression).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SORTS = {"sort", "argsort", "topk", "kthvalue", "msort"}
_GATHERS = {"gather", "index_select", "take_along_dim", "index"}
# In-place scatters touch their target only where the index points.
_SCATTERS = {"scatter_add_", "scatter_", "scatter_reduce_", "index_put_", "index_add_", "index_copy_"}
# Operations that only make or describe a view, or read metadata.
_FREE = {"detach", "alias", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
         "new_empty_strided", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
         "is_same_size", "resolve_conj", "resolve_neg", "set_"}


def distinct_elements(t: torch.Tensor) -> int:
    """Elements a kernel must touch: the product of the sizes of dimensions with a non-zero
    stride (a broadcast dimension is one element wide)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n if t.dim() else 1


@dataclass
class Traffic:
    """Totals of one counted region."""

    big: int                                  # elements of one pass over [B, V]
    vocab: int
    read: int = 0
    written: int = 0
    passes: int = 0
    sorts: int = 0
    ops: Counter = field(default_factory=Counter)        # big ops by name
    big_bytes: Counter = field(default_factory=Counter)  # bytes of big ops by name

    def add(self, name: str, read: int, written: int, big: bool, sort: bool) -> None:
        self.read += read
        self.written += written
        if big:
            self.passes += 1
            self.ops[name] += 1
            self.big_bytes[name] += read + written
        if sort:
            self.sorts += 1

    @property
    def moved(self) -> int:
        return self.read + self.written


class TrafficMode(TorchDispatchMode):
    """Counts every aten operation run while it is active into ``self.traffic``."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.traffic = Traffic(big=rows * vocab, vocab=vocab)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _FREE:
            return out
        schema = func._schema
        written_args, read_tensors = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            if arg.alias_info is not None and arg.alias_info.is_write:
                written_args += tensors
                if arg.name == "out" or arg.kwarg_only:
                    continue                  # out=: written, not read
            read_tensors += tensors
        written = written_args or [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in _SCATTERS and written_args:
            target = written_args[0]
            sources = [t for t in read_tensors if t is not target]
            touched = max((distinct_elements(t) for t in sources), default=0)
            read_tensors = sources
            written = []
            write_extra = touched * target.element_size()
        else:
            write_extra = 0
        if name in _GATHERS and read_tensors:
            # a gather reads one element of its source per index, not the whole source
            src = read_tensors[0]
            idx = [t for t in read_tensors[1:] if not t.is_floating_point()]
            n = distinct_elements(idx[0]) if idx else distinct_elements(src)
            read_tensors = read_tensors[1:]
            read_n = [(n, src.element_size())] + [(distinct_elements(t), t.element_size()) for t in read_tensors]
        else:
            read_n = [(distinct_elements(t), t.element_size()) for t in read_tensors]
        write_n = [(distinct_elements(t), t.element_size()) for t in written]
        big = any(n >= self.traffic.big for n, _ in read_n + write_n)
        sort = (name in _SORTS and read_tensors and read_tensors[0].dim()
                and read_tensors[0].shape[-1] == self.traffic.vocab
                and (name != "topk" or int(args[1]) * 4 > self.traffic.vocab))
        self.traffic.add(name, sum(n * s for n, s in read_n), sum(n * s for n, s in write_n) + write_extra,
                         big, bool(sort))
        return out


def count(fn: Callable[[], object], rows: int, vocab: int) -> Traffic:
    """The traffic of one call of ``fn`` (B = ``rows`` requests, V = ``vocab``)."""
    with TrafficMode(rows, vocab) as mode:
        fn()
    return mode.traffic


# ---------------------------------------------------------------------- the table
V_DEFAULT = 128256
CONFIGS = {
    "plain": dict(temperature=0.7),
    "top-k+top-p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "top-p": dict(temperature=0.7, top_p=0.9),
    "seeded": dict(temperature=0.7, seed=0),
    "seeded top-k+top-p": dict(temperature=0.7, top_k=50, top_p=0.9, seed=0),
    "penalties": dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                      frequency_penalty=0.2, presence_penalty=0.1),
    # the fourth release: every new filter at once, and mirostat, on top of top-k+top-p
    "fourth": dict(temperature=0.7, top_k=50, top_p=0.9, dynatemp_range=0.3, smoothing_factor=0.3,
                   top_a=0.02, epsilon_cutoff=0.0003, eta_cutoff=0.0009, tfs=0.95, p_less="norm"),
    "mirostat": dict(temperature=0.7, top_k=50, top_p=0.9, mirostat_tau=3.0),
}
#: One new sampler at a time on top of top-k+top-p (``--configs +tfs`` and so on; not in the
#: default table), a request's own order of the same three filters, and kept sets.
_TOP_K_TOP_P = dict(temperature=0.7, top_k=50, top_p=0.9)
SINGLE = {
    "+dynatemp": dict(dynatemp_range=0.3), "+smoothing": dict(smoothing_factor=0.3),
    "+top-a": dict(top_a=0.02), "+epsilon": dict(epsilon_cutoff=0.0003), "+eta": dict(eta_cutoff=0.0009),
    "+tfs": dict(tfs=0.95), "+p-less": dict(p_less="norm"), "+adaptive-p": dict(adaptive_p_target=0.3),
    "+own-order": dict(sampler_order=["top_p", "temperature", "top_k"]),
    "+kept": dict(return_kept=True),
}
DEFAULT_CONFIGS = tuple(CONFIGS)
CONFIGS.update({name: dict(_TOP_K_TOP_P, **extra) for name, extra in SINGLE.items()})


def _batch(sampler, B: int, V: int, params: dict, device: str):
    from corelib import SamplingParams
    batch = sampler.new_batch(V)
    for i in range(B):
        p = dict(params)
        if "seed" in p:
            p["seed"] = i
        batch.add(f"r{i}", SamplingParams(**p), prompt_token_ids=[(7 * i + j) % V for j in range(16)])
    return batch


def measure(runner: str, config: str, B: int, K: int, V: int = V_DEFAULT,
            device: str = "meta") -> tuple[Traffic, float]:
    """(traffic of the second call, host seconds of that call) of ``sample`` (K = 0) or
    ``verify`` with draft probabilities (K > 0) on the torch path ("torch") or the graph
    runner's eager form ("graph"), bf16 logits. The first call is not counted (a graph runner
    captures then)."""
    from . import CudaSampler, GraphedSampler
    from .race import RacePath, seeded_race
    sampler = CudaSampler(device, use_flashinfer=False)
    if device == "meta":
        sampler.race = RacePath(seeded_race, "triton")        # as a CUDA device runs it
    target = GraphedSampler(sampler, use_graphs=False) if runner == "graph" else sampler
    batch = _batch(sampler, B, V, CONFIGS[config], device)
    if K == 0:
        logits = torch.zeros((B, V), dtype=torch.bfloat16, device=device)
        call = lambda: target.sample(logits, batch)                     # noqa: E731
    else:
        logits = torch.zeros((B, K + 1, V), dtype=torch.bfloat16, device=device)
        drafts = torch.zeros((B, K), dtype=torch.long, device=device)
        probs = torch.full((B, K, V), 1.0 / V, device=device)
        call = lambda: target.verify(logits, batch, drafts, probs)      # noqa: E731
    call()
    start = time.perf_counter()
    traffic = count(call, B, V)
    return traffic, time.perf_counter() - start


def table(batch_sizes=(1, 32, 128), ks=(0, 4), configs=DEFAULT_CONFIGS, runners=("torch", "graph"),
          V: int = V_DEFAULT, emit: Optional[Callable[[str], None]] = print) -> list[dict]:
    """Rows of (runner, config, B, K, passes, MB moved, sorts); printed as a markdown table
    row by row through ``emit``."""
    rows = []
    if emit:
        emit("| runner | config | K | B | passes over [B, V] | MB moved | sorts |")
        emit("|---|---|---|---|---|---|---|")
    for runner in runners:
        for config in configs:
            for K in ks:
                for B in batch_sizes:
                    t, _ = measure(runner, config, B, K, V)
                    row = dict(runner=runner, config=config, B=B, K=K, passes=t.passes,
                               mb=t.moved / 1e6, sorts=t.sorts)
                    rows.append(row)
                    if emit:
                        emit(f"| {runner} | {config} | {K} | {B} | {t.passes} | {t.moved / 1e6:.1f} | {t.sorts} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--ks", default="0,4")
    parser.add_argument("--vocab", type=int, default=V_DEFAULT)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--runners", default="torch,graph")
    parser.add_argument("--ops", action="store_true", help="per-op passes of each case instead")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    runners = args.runners.split(",")
    if args.ops:
        for runner in runners:
            for config in configs:
                for K in ks:
                    for B in sizes:
                        t, host = measure(runner, config, B, K, args.vocab)
                        print(f"{runner} {config} K={K} B={B}: {t.passes} passes, {t.moved / 1e6:.1f} MB, "
                              f"{t.sorts} sorts; host {host * 1e3:.1f} ms (counting included)")
                        for name, n in t.ops.most_common():
                            print(f"  {name}: {n} ({t.big_bytes[name] / 1e6:.1f} MB)")
        return 0
    table(sizes, ks, configs, runners, args.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
