"""One sequence at a time: the cpu backend against llama.cpp's sampler chain (issue 35).

What a user who runs a model locally compares corelib with is llama.cpp, whose samplers are
C++ over an array of ``llama_token_data`` (id, logit, p). This script times, per token at
B = 1, on the same float32 logits in one process:

- llama.cpp (llama-cpp-python's low-level bindings, no model loaded): the ``llama_token_data``
  array filled from the logits, ``llama_sampler_apply`` of the chain (its last sampler
  selects the token: ``dist``, ``greedy``, or mirostat / adaptive-p themselves), then
  ``llama_sampler_accept`` of the token, as ``llama_sampler_sample`` does in C;
- corelib's ``cpu`` backend: one ``sample`` plus ``append`` (``Sampler.step``) of a batch of
  one request, unseeded and seeded.

How the array is filled: ``llama_sampler_sample`` writes ``{i, logits[i], 0}`` for every
token in a C loop. The bindings expose no such fill, so the array here is numpy memory laid
out as ``llama_token_data`` (int32, float32, float32: 12 bytes, no padding), viewed as a
``[V, 3]`` array of 4-byte words, that the ``llama_token_data_array`` points at: each call
copies a template holding the ids and zero probabilities (one contiguous copy) and then the
row's logits into the middle column (one strided copy). Both loops run in C inside numpy; no
Python runs per token. (A structured-array copy of the same bytes goes field by field and
costs about six times as much.) The fill is timed with the chain (it is part of llama.cpp's
per-token cost: about 0.2 ms at V = 128256, roughly twice a single C loop's), and its own
cost is printed.

The calls take turns in one process (each round starting with the next of them), each round
on the next of ``--rows`` logit rows, the
core's cache flushed before every call (``harness.CacheFlush``: a model's forward pass would
evict it; ``--flush-mib`` sets how much it writes: the default 16 MiB evicts the L2, twice
the last-level cache evicts that too); one torch thread by default (llama.cpp's samplers use one); medians of
``--tokens`` rounds. The ratio is corelib / llama.cpp: at most 1 means corelib is as fast.

The same script compares the kept sets of the samplers both implement, on the same logits:
llama.cpp's array after the chain without its selecting sampler (finite entries), corelib's
``processed_logits`` (finite entries). Where they differ it says why, by the contract's
choices: corelib keeps every token tied with the boundary where llama.cpp's position cut
keeps some of them (logits rounded to bfloat16, as models emit them, have such ties), and
corelib's order divides by the temperature before the filters and cuts min-p before top-k
and top-p, where llama.cpp's chain runs top-k, top-p, min-p, then the temperature (corelib
with ``sampler_order`` in llama.cpp's order is compared too).

llama-cpp-python is an optional benchmark dependency, not a dependency of corelib. Install it
into the main venv (it builds llama.cpp from source, a few minutes):

    .venv/bin/pip install llama-cpp-python==0.3.36

(or ``pip install -e .[oracle]``; ``scripts/lib.sh``'s ``ensure_llama_cpp`` does the same).
Without it the script says so and exits with status 0.

    .venv/bin/python benchmarks/llama_cpp_compare.py                    # both V, every chain
    .venv/bin/python benchmarks/llama_cpp_compare.py --tokens 600 --vocab 128256
    .venv/bin/python benchmarks/llama_cpp_compare.py --only "min-p 0.05" --threads 2
    .venv/bin/python benchmarks/llama_cpp_compare.py --kept-only        # the kept-set report
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from corelib import SamplingParams
from corelib.bench import machine_description, make_logits

from corelib_cpu.sampler import CpuSampler
from harness import CacheFlush, add_run_arguments, interleaved, load_average, run_settings, timed

VOCABS = (128256, 151936)
SEED = 1234


@dataclass(frozen=True)
class Chain:
    """One row of the table: corelib's parameters and llama.cpp's chain for the same
    sampling. ``llama``: (init function name, arguments) in chain order, the selecting
    sampler last. ``kept``: whether the kept sets are compared (the chain without its
    selecting sampler is a filter); ``seeded``: whether a seeded corelib row is timed."""

    name: str
    params: dict
    llama: tuple
    kept: bool = True
    seeded: bool = True


def _dist():
    return ("llama_sampler_init_dist", (SEED,))


CHAINS: tuple[Chain, ...] = (
    Chain("top-k 40, top-p 0.95, min-p 0.05, T 0.8 (llama.cpp's defaults)",
          dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8),
          (("llama_sampler_init_top_k", (40,)), ("llama_sampler_init_top_p", (0.95, 1)),
           ("llama_sampler_init_min_p", (0.05, 1)), ("llama_sampler_init_temp", (0.8,)), _dist())),
    Chain("min-p 0.05 alone", dict(min_p=0.05),
          (("llama_sampler_init_min_p", (0.05, 1)), _dist())),
    Chain("top-k 50, top-p 0.95, T 0.7", dict(top_k=50, top_p=0.95, temperature=0.7),
          (("llama_sampler_init_top_k", (50,)), ("llama_sampler_init_top_p", (0.95, 1)),
           ("llama_sampler_init_temp", (0.7,)), _dist())),
    Chain("greedy", dict(temperature=0.0), (("llama_sampler_init_greedy", ()),), kept=False,
          seeded=False),
    Chain("top-p 0.9 alone", dict(top_p=0.9), (("llama_sampler_init_top_p", (0.9, 1)), _dist())),
    Chain("plain T 1", dict(), (_dist(),), kept=False),
    # the single samplers both implement
    Chain("top-k 40 alone", dict(top_k=40), (("llama_sampler_init_top_k", (40,)), _dist())),
    Chain("typical 0.95", dict(typical_p=0.95), (("llama_sampler_init_typical", (0.95, 1)), _dist())),
    Chain("top-k 40, typical 0.9", dict(top_k=40, typical_p=0.9),
          (("llama_sampler_init_top_k", (40,)), ("llama_sampler_init_typical", (0.9, 1)), _dist())),
    Chain("top-n-sigma 1.0", dict(top_n_sigma=1.0), (("llama_sampler_init_top_n_sigma", (1.0,)), _dist())),
    Chain("XTC p 1, t 0.05", dict(xtc_probability=1.0, xtc_threshold=0.05),
          (("llama_sampler_init_xtc", (1.0, 0.05, 1, SEED)), _dist())),
    Chain("mirostat v2 tau 5, eta 0.1", dict(mirostat_tau=5.0, mirostat_eta=0.1),
          (("llama_sampler_init_mirostat_v2", (SEED, 5.0, 0.1)),), kept=False),
    Chain("adaptive-p 0.3, decay 0.9", dict(adaptive_p_target=0.3, adaptive_p_decay=0.9),
          (("llama_sampler_init_adaptive_p", (0.3, 0.9, SEED)),), kept=False),
    Chain("dynamic T 0.8 +- 0.5", dict(temperature=0.8, dynatemp_range=0.5, dynatemp_exponent=1.0),
          (("llama_sampler_init_temp_ext", (0.8, 0.5, 1.0)), _dist()), kept=False),
)


# ---------------------------------------------------------------------- llama.cpp's side
class LlamaChain:
    """A llama.cpp sampler chain and a ``llama_token_data`` array of V entries it runs on
    (see the module docstring for the fill). ``step(row)``: fill, apply, accept; returns the
    token."""

    def __init__(self, llama_cpp, links: tuple, V: int, select: bool = True):
        self.ll = llama_cpp
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        self.chain = llama_cpp.llama_sampler_chain_init(params)
        for name, args in (links if select else links[:-1]):
            sampler = getattr(llama_cpp, name)(*args)
            if not sampler:
                raise RuntimeError(f"{name}{args} returned NULL")
            llama_cpp.llama_sampler_chain_add(self.chain, sampler)   # the chain owns it
        dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        assert dtype.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
        self.cur = np.zeros(V, dtype=dtype)
        template = np.zeros(V, dtype=dtype)
        template["id"] = np.arange(V, dtype=np.int32)
        # [V, 3] 4-byte words: plain copies, where the structured dtype copies field by field
        self.words, self.template = self.cur.view(np.int32).reshape(V, 3), template.view(np.int32).reshape(V, 3)
        self.logit_column = self.cur.view(np.float32).reshape(V, 3)[:, 1]
        self.pointer = ctypes.cast(self.cur.ctypes.data, llama_cpp.llama_token_data_p)
        self.array = llama_cpp.llama_token_data_array(data=self.pointer, size=V, selected=-1, sorted=False)
        self.V = V

    def fill(self, row: np.ndarray) -> None:
        """``{i, row[i], 0}`` for every token (two numpy copies, in C), and the array reset
        (XTC moves its data pointer, the filters its size)."""
        np.copyto(self.words, self.template)
        self.logit_column[:] = row
        a = self.array
        a.data, a.size, a.selected, a.sorted = self.pointer, self.V, -1, False

    def step(self, row: np.ndarray) -> int:
        self.fill(row)
        self.ll.llama_sampler_apply(self.chain, ctypes.byref(self.array))
        token = self.array.data[self.array.selected].id
        self.ll.llama_sampler_accept(self.chain, token)
        return token

    def kept(self, row: np.ndarray) -> set:
        """The tokens the chain (built with ``select=False``) keeps of ``row``: the finite
        entries of the array after it."""
        self.fill(row)
        self.ll.llama_sampler_apply(self.chain, ctypes.byref(self.array))
        size = self.array.size
        view = np.ctypeslib.as_array(
            ctypes.cast(self.array.data, ctypes.POINTER(ctypes.c_int32)), shape=(size * 3,))
        ids = view[0::3].copy()
        logits = view[1::3].copy().view(np.float32)
        return set(ids[np.isfinite(logits)].tolist())

    def close(self) -> None:
        self.ll.llama_sampler_free(self.chain)


# ---------------------------------------------------------------------- corelib's side
def corelib_step(sampler: CpuSampler, V: int, params: dict, seed: Optional[int]):
    """(a function ``step(row)`` that samples and appends one token of the [1, V] logits
    ``row`` for a batch of one request, the batch)."""
    batch = sampler.new_batch(V)
    batch.add("r", SamplingParams(**params, **({} if seed is None else dict(seed=seed))))
    return lambda row: sampler.step(row, batch), batch


def corelib_kept(sampler: CpuSampler, row: torch.Tensor, params: dict) -> set:
    batch = sampler.new_batch(row.shape[-1])
    batch.add("r", SamplingParams(**params))
    final = sampler.processed_logits(row, batch)[0]
    return set(torch.isfinite(final).nonzero().flatten().tolist())


# ---------------------------------------------------------------------- timing
@dataclass
class Cell:
    chain: str
    V: int
    llama_ms: float
    corelib_ms: float
    seeded_ms: Optional[float]
    spread: float            # the largest spread of the three (interquartile / median)

    @property
    def ratio(self) -> float:
        return self.corelib_ms / self.llama_ms

    @property
    def seeded_ratio(self) -> Optional[float]:
        return None if self.seeded_ms is None else self.seeded_ms / self.llama_ms


def spread(values: list) -> float:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else 0.0


def time_chain(llama_cpp, chain: Chain, logits: torch.Tensor, tokens: int, clock, flush) -> Cell:
    R, V = logits.shape
    rows_np = logits.numpy()
    sampler = CpuSampler()
    llama = LlamaChain(llama_cpp, chain.llama, V)
    unseeded, _ = corelib_step(sampler, V, chain.params, None)
    seeded = corelib_step(CpuSampler(), V, chain.params, 100_003)[0] if chain.seeded else None
    at = [0]                   # the round's row: every call of a round reads the same logits
    calls = {"llama.cpp": lambda: llama.step(rows_np[at[0]]),
             "corelib": lambda: unseeded(logits[at[0]:at[0] + 1])}
    if seeded is not None:
        calls["corelib seeded"] = lambda: seeded(logits[at[0]:at[0] + 1])
    # rotated: a call right after another call of the same code finds more of it warm (branch
    # predictors, the L3 the flush leaves) than one right after llama.cpp's, so a fixed order
    # would favour the second corelib call; each round reads the next logits row
    times = interleaved(calls, repeats=tokens, warmup=3, clock=clock, before=flush, rotate=True,
                        round_start=lambda i: at.__setitem__(0, i % R))
    llama.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    return Cell(chain.name, V, med["llama.cpp"], med["corelib"], med.get("corelib seeded"),
                max(spread(t) for t in times.values()))


def fill_ms(llama_cpp, logits: torch.Tensor, clock, flush, tokens: int) -> float:
    """The median cost of llama.cpp's array fill alone (part of every llama.cpp time)."""
    llama = LlamaChain(llama_cpp, (_dist(),), logits.shape[1])
    rows = logits.numpy()
    out = []
    for i in range(tokens):
        flush()
        out.append(timed(llama.fill, rows[i % rows.shape[0]], clock=clock))
    llama.close()
    return statistics.median(out)


# ---------------------------------------------------------------------- kept sets
#: llama.cpp's filters by the name ``sampler_order`` gives corelib's.
ORDER_NAMES = {"llama_sampler_init_top_k": "top_k", "llama_sampler_init_top_p": "top_p",
               "llama_sampler_init_min_p": "min_p", "llama_sampler_init_temp": "temperature",
               "llama_sampler_init_typical": "typical_p", "llama_sampler_init_top_n_sigma": "top_n_sigma",
               "llama_sampler_init_xtc": "xtc"}


def kept_report(llama_cpp, V: int, rows: int) -> list[str]:
    """Lines comparing the kept sets of each chain with ``kept`` on ``rows`` logit rows of
    each kind (language-model-like, and the same rounded to bfloat16): llama.cpp's, corelib's
    in the contract's order, and corelib's in llama.cpp's order (``sampler_order``), with the
    reason for each difference."""
    sampler = CpuSampler()
    lines = ["| chain | logits | equal | equal in llama.cpp's order | llama.cpp | corelib | "
             "corelib, llama.cpp's order | why they differ |", "|---|---|---|---|---|---|---|---|"]
    kinds = {"float32": make_logits(rows, V, "peaked", seed=7),
             "bfloat16": make_logits(rows, V, "peaked", seed=7).bfloat16().float()}
    for chain in CHAINS:
        if not chain.kept:
            continue
        links = chain.llama[:-1]                 # the filters, without the selecting sampler
        order = [ORDER_NAMES[name] for name, _ in links]
        reordered = dict(chain.params, sampler_order=order) if len(order) > 1 else chain.params
        for kind, logits in kinds.items():
            llama = LlamaChain(llama_cpp, chain.llama, V, select=False)
            equal, equal_order, sizes, reasons = 0, 0, [], set()
            for r in range(rows):
                row = logits[r:r + 1]
                theirs = llama.kept(row[0].numpy())
                ours = corelib_kept(sampler, row, chain.params)
                ours_order = corelib_kept(sampler, row, reordered) if reordered is not chain.params else ours
                sizes.append((len(theirs), len(ours), len(ours_order)))
                equal += ours == theirs
                equal_order += ours_order == theirs
                if ours != ours_order:
                    reasons.add("order: the contract divides by T before the filters (and cuts min-p before "
                                "top-k and top-p), llama.cpp's chain applies T last")
                if ours_order != theirs:
                    reasons.add(why(row[0], ours_order, theirs))
            llama.close()
            med = [int(statistics.median(s[i] for s in sizes)) for i in range(3)]
            lines.append(f"| {chain.name} | {kind} | {equal}/{rows} | {equal_order}/{rows} | "
                         f"{med[0]} | {med[1]} | {med[2]} | {'; '.join(sorted(reasons)) or '-'} |")
    return lines


def why(row: torch.Tensor, ours: set, theirs: set) -> str:
    """Why corelib's kept set ``ours`` (in llama.cpp's order) differs from llama.cpp's
    ``theirs`` on the logits ``row``: ties at the boundary (every extra token of corelib's
    has the logit of llama.cpp's last kept one), or rounding at the threshold (the tokens in
    one set only are the last of the larger set by logit, next to the boundary)."""
    extra, missing = ours - theirs, theirs - ours
    if theirs and extra and not missing:
        boundary = min(float(row[t]) for t in theirs)
        if all(float(row[t]) == boundary for t in extra):
            return "ties at the boundary kept by corelib"
    both = ours & theirs
    if both and max(float(row[t]) for t in extra | missing) <= min(float(row[t]) for t in both):
        return f"float rounding at the threshold ({len(extra)} more, {len(missing)} fewer in corelib)"
    return f"inside the set ({len(extra)} more, {len(missing)} fewer in corelib)"


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=300, help="rounds (tokens) per cell (default 300)")
    parser.add_argument("--rows", type=int, default=16, help="distinct logit rows the rounds cycle over")
    parser.add_argument("--vocab", type=str, default=",".join(map(str, VOCABS)),
                        help="vocabulary sizes, comma-separated (default 128256,151936)")
    parser.add_argument("--only", action="append", default=[],
                        help="time the chains whose name contains this (repeatable)")
    parser.add_argument("--profile", choices=("peaked", "flat"), default="peaked",
                        help="logits: language-model-like (default) or standard normal")
    parser.add_argument("--kept-only", action="store_true", help="only the kept-set report")
    parser.add_argument("--kept-rows", type=int, default=8, help="rows per kept-set comparison")
    parser.add_argument("--flush-mib", type=int, default=16,
                        help="MiB the cache flush writes and reads before each call (default 16: "
                             "the cores' L2 and part of the L3; twice the L3 evicts it all, as a "
                             "forward pass through a model's weights does)")
    add_run_arguments(parser, repeats=1, repeats_help="unused (see --tokens)")
    args = parser.parse_args(argv)
    for name in ("tokens", "rows", "kept_rows", "flush_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        vocabs = [int(v) for v in args.vocab.split(",")]
    except ValueError:
        parser.error(f"--vocab must be comma-separated integers, got {args.vocab!r}")
    try:
        import llama_cpp
    except ImportError as exc:
        print(f"llama-cpp-python is not installed ({exc}): install it with "
              "`.venv/bin/pip install llama-cpp-python==0.3.36` (builds llama.cpp from source) "
              "to compare with llama.cpp's samplers; nothing to do.", file=sys.stderr)
        return 0
    clock = run_settings(args, parser)
    chains = [c for c in CHAINS if not args.only or any(o in c.name for o in args.only)]
    print(f"# {machine_description()}; llama-cpp-python {llama_cpp.__version__}; "
          f"torch threads {torch.get_num_threads()}; clock {args.clock}; flush {args.flush_mib} MiB; "
          f"load {load_average():.2f}")
    if not args.kept_only:
        flush = CacheFlush(args.flush_mib)
        for V in vocabs:
            logits = make_logits(args.rows, V, args.profile, seed=V)
            print(f"\n## V = {V}: ms per token, medians of {args.tokens} "
                  f"(llama.cpp's array fill alone: {fill_ms(llama_cpp, logits, clock, flush, 100):.3f} ms)\n")
            print("| chain | llama.cpp | corelib | ratio | corelib seeded | ratio | spread |")
            print("|---|---|---|---|---|---|---|")
            for chain in chains:
                c = time_chain(llama_cpp, chain, logits, args.tokens, clock, flush)
                seeded = "-" if c.seeded_ms is None else f"{c.seeded_ms:.3f}"
                seeded_ratio = "-" if c.seeded_ratio is None else f"{c.seeded_ratio:.2f}x"
                print(f"| {c.chain} | {c.llama_ms:.3f} | {c.corelib_ms:.3f} | {c.ratio:.2f}x | "
                      f"{seeded} | {seeded_ratio} | {100 * c.spread:.0f}% |", flush=True)
        print("\nratio = corelib / llama.cpp (at most 1: corelib is as fast); spread: the largest "
              "interquartile range over median of the cell's three columns")
    print(f"\n## kept sets, V = {vocabs[0]}, {args.kept_rows} rows of each kind "
          "(median sizes)\n")
    print("\n".join(kept_report(llama_cpp, vocabs[0], args.kept_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
