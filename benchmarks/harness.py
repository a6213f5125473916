"""What the benchmark scripts share: clocks, timing loops, summaries, vLLM's sampler, and the
sort-based baseline.

Every script reports ratios measured in one run against something timed alongside it, the
calls taking turns so that load from other processes on a shared machine hits every side
alike. The pieces:

- clocks: ``wall`` (``time.perf_counter``) or ``thread`` (``time.thread_time``: the calling
  thread's CPU time, which leaves out the time other processes hold the core, and counts no
  other thread's work, so it only means something with one torch thread);
- ``timed`` / ``timed_call``: one call in milliseconds; ``samples``: warm-up then repeats of
  one call; ``interleaved``: several calls taking turns, each repeat a round; ``CacheFlush``:
  evicts the cache before a timed call, as a model's forward pass would;
- ``Summary``: median, minimum, maximum and spread of a list of milliseconds;
- ``load_vllm`` / ``vllm_metadata``: vLLM's own ``Sampler`` and the ``SamplingMetadata`` its
  input batch builds for a batch of requests with one configuration;
- ``sort_based_filter`` / ``sort_based_sample``: the common way to sample with top-k and
  top-p, one full sort of each row, that the backends' filters are compared with;
- ``extract_revision``: another git revision's files, for the scripts that compare this
  checkout with it (``--base`` / ``--before``).

Scripts are run from the repository root (``python benchmarks/<script>.py``); Python puts
this folder on the path, so they import this module as ``harness``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

# ---------------------------------------------------------------------- clocks
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}

CLOCK_HELP = ("wall time (default), or the calling thread's CPU time: on a loaded machine it "
              "leaves out the time other processes hold the core (one torch thread only: other "
              "threads' work is not counted)")


def add_clock_argument(parser: argparse.ArgumentParser, default: str = "wall") -> None:
    """``--clock {thread,wall}`` on ``parser``; read it back with ``clock_from(args, parser)``."""
    parser.add_argument("--clock", choices=sorted(CLOCKS), default=default, help=CLOCK_HELP)


def clock_from(args: argparse.Namespace, parser: argparse.ArgumentParser,
               threads: Optional[int] = None) -> Callable[[], float]:
    """The clock ``--clock`` names. The thread clock counts the calling thread only, so it is
    refused (a parser error) with more than one torch thread."""
    if args.clock == "thread" and threads is not None and threads != 1:
        parser.error("--clock thread counts the calling thread only: use --threads 1")
    return CLOCKS[args.clock]


def add_run_arguments(parser: argparse.ArgumentParser, repeats: int,
                      repeats_help: str = "timed rounds per cell") -> None:
    """``--repeats``, ``--threads`` (torch threads, default 1) and ``--clock`` on ``parser``;
    ``run_settings`` reads them back."""
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_clock_argument(parser)


def run_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Callable[[], float]:
    """Sets torch's threads to ``--threads`` and returns the clock ``--clock`` names."""
    clock = clock_from(args, parser, args.threads)
    torch.set_num_threads(args.threads)
    return clock


def load_average() -> float:
    """The one-minute load average: printed with each run, as figures taken under load read
    differently."""
    return os.getloadavg()[0]


# ---------------------------------------------------------------------- timing
def timed_call(fn: Callable[..., object], *args,
               clock: Callable[[], float] = time.perf_counter) -> tuple[float, object]:
    """(milliseconds of one ``fn(*args)``, its result). The arguments are passed through, so a
    step that takes its logits is timed without a wrapper call around it."""
    start = clock()
    out = fn(*args)
    return (clock() - start) * 1000.0, out


def timed(fn: Callable[..., object], *args,
          clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds of one ``fn(*args)``."""
    start = clock()
    fn(*args)
    return (clock() - start) * 1000.0


def samples(fn: Callable[[], object], repeats: int, warmup: int = 1,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return [timed(fn, clock=clock) for _ in range(repeats)]


def interleaved(calls: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter,
                before: Optional[Callable[[], object]] = None, rotate: bool = False,
                round_start: Optional[Callable[[int], object]] = None) -> dict[str, list[float]]:
    """Milliseconds of each named call over ``repeats`` rounds, the calls taking turns in each
    round (in the mapping's order) so they share the machine's load; ``warmup`` untimed rounds
    first (workspace buffers, plans, lazy imports). ``before``: run untimed before every call
    (a ``CacheFlush``, say). ``rotate``: round r starts with call r (mod their number), so no
    call always follows the same one (a call after a second of other work, or after another
    call of the same code, finds the caches and predictors otherwise than its neighbour).
    ``round_start(r)``: run untimed before round r (the next round's inputs, say)."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        if round_start is not None:
            round_start(r)
        first = r % len(names) if rotate and names else 0
        for name in names[first:] + names[:first]:
            if before is not None:
                before()
            times[name].append(timed(calls[name], clock=clock))
    return times


class CacheFlush:
    """Called before a timed call, evicts what earlier calls left in the core's cache, as a
    model's forward pass does between two sampling steps: it writes then reads a buffer of
    ``mib`` MiB (default 16, four times a 4 MiB L2). Untimed; costs about a millisecond."""

    def __init__(self, mib: int = 16):
        if mib < 1:
            raise ValueError(f"mib must be >= 1, got {mib!r}")
        self.buffer = torch.empty(mib * (1 << 20) // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.fill_(1.0)
        float(self.buffer.sum())


def medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each named list of milliseconds."""
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Summary:
    """Median, minimum and maximum of a list of milliseconds, and its spread: the
    interquartile range over the median (0.1: the middle half of the calls lies within 10%
    of the median's size)."""
    median: float
    min: float
    max: float
    spread: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Summary":
        values = sorted(values)
        if not values:
            raise ValueError("values must hold at least one time, got none")
        med = statistics.median(values)
        if len(values) >= 2:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(med, values[0], values[-1], (q3 - q1) / med if med > 0 else 0.0, len(values))

    def __str__(self) -> str:
        return (f"{self.median:.3f} ms (min {self.min:.3f}, max {self.max:.3f}, "
                f"spread {100 * self.spread:.0f}%, n = {self.count})")


# ---------------------------------------------------------------------- vLLM's sampler
@dataclass(frozen=True)
class Vllm:
    """vLLM's V1 sampler class and the types its metadata is built from."""
    Sampler: type
    SamplingMetadata: type
    LogitsProcessors: type
    version: str


def load_vllm() -> Optional[Vllm]:
    """vLLM's ``Sampler`` and metadata types, or None (said on stderr) when vLLM is not
    importable: the scripts then time corelib alone. vLLM is not a dependency of corelib; the
    vLLM venv has it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import vllm
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.sampler import Sampler
    except Exception as exc:   # ImportError, or a vLLM build that fails to initialise
        print(f"vLLM is not importable ({type(exc).__name__}: {exc}); timing corelib alone",
              file=sys.stderr)
        return None
    return Vllm(Sampler, SamplingMetadata, LogitsProcessors, vllm.__version__)


PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def vllm_metadata(vllm: Vllm, B: int, params: Mapping[str, object],
                  seeds: Optional[Sequence[int]] = None,
                  prompts: Optional[Sequence[Sequence[int]]] = None,
                  outputs: Optional[list[list[int]]] = None):
    """The ``SamplingMetadata`` vLLM's input batch builds for B random rows that all have the
    corelib ``SamplingParams`` fields ``params`` (temperature, top_k, top_p, logprobs and the
    three penalties are read): a generator per row seeded with ``seeds[i]`` when given;
    penalties on when ``params`` sets one, then with the token lists ``prompts`` (B equal
    lengths); ``outputs``: the B lists vLLM appends the generated tokens to (the caller
    extends them after each call, as vLLM's model runner does)."""
    generators = {}
    if seeds is not None:
        generators = {i: torch.Generator().manual_seed(int(seeds[i])) for i in range(B)}
    penalties = any(name in params for name in PENALTIES)
    if penalties and prompts is None:
        raise ValueError("prompts must be given when params set a penalty, got None")
    top_k, top_p = params.get("top_k"), params.get("top_p")
    return vllm.SamplingMetadata(
        temperature=torch.full((B,), float(params.get("temperature", 1.0))),
        all_greedy=False,
        all_random=True,
        top_p=None if top_p is None else torch.full((B,), float(top_p)),
        top_k=None if top_k is None else torch.full((B,), int(top_k), dtype=torch.int32),
        generators=generators,
        max_num_logprobs=params.get("logprobs"),
        no_penalties=not penalties,
        prompt_token_ids=(torch.tensor([list(p) for p in prompts], dtype=torch.long)
                          if penalties else None),
        frequency_penalties=torch.full((B,), float(params.get("frequency_penalty", 0.0))),
        presence_penalties=torch.full((B,), float(params.get("presence_penalty", 0.0))),
        repetition_penalties=torch.full((B,), float(params.get("repetition_penalty", 1.0))),
        output_token_ids=outputs if outputs is not None else [[] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=vllm.LogitsProcessors(),
    )


# ---------------------------------------------------------------------- the sort-based baseline
def sort_based_filter(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, vocabulary_order: bool = True):
    """Temperature, top-k and top-p the common way: one full sort of each row, top-k by rank,
    top-p by the mass before each token in sorted order. Traceable (no branch on values).

    ``x``: float ``[B, V]`` logits, not modified. ``temperature``: float ``[B]``, 0 for a
    greedy row (not divided). ``top_k``: int ``[B]``, 0 disables. ``top_p``: float ``[B]``,
    1.0 disables. Returns a new float ``[B, V]`` with the dropped tokens at -inf, in vocabulary
    order (one scatter back), or with ``vocabulary_order=False`` the filtered values in sorted
    order and the int64 ``[B, V]`` vocabulary ids of each position (no scatter)."""
    V = x.shape[-1]
    greedy = temperature == 0
    x = x.float() / torch.where(greedy, 1.0, temperature.float())[:, None]
    ordered, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(V, device=x.device)[None, :]
    ordered = ordered.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # top_p = 1 keeps everything: float32 sums can reach 1.0 before the tail ends
    ordered = ordered.masked_fill((top_p[:, None] < 1) & (mass_before >= top_p[:, None]),
                                  float("-inf"))
    if not vocabulary_order:
        return ordered, order
    return torch.full_like(x, float("-inf")).scatter(1, order, ordered)


def sort_based_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, generator: Optional[torch.Generator] = None
                      ) -> torch.Tensor:
    """The sort-based sampler: ``sort_based_filter`` in sorted order, then an exponential race
    over the kept probabilities (one draw per row, no wait on the host), the winner mapped back
    through the sort's order. Greedy rows take their largest logit. Shapes as
    ``sort_based_filter``; returns int64 ``[B]``; ``logits`` is not modified."""
    ordered, order = sort_based_filter(logits, temperature, top_k, top_p, vocabulary_order=False)
    probs = torch.softmax(ordered, dim=-1)
    race = probs / torch.empty_like(probs).exponential_(generator=generator)
    winner = torch.where(temperature == 0, 0, race.argmax(dim=-1))
    return order.gather(1, winner[:, None]).squeeze(1)


def per_row(B: int, device, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """(temperature, top_k, top_p) as the ``[B]`` tensors ``sort_based_*`` take, one value for
    every row."""
    return (torch.full((B,), float(temperature), device=device),
            torch.full((B,), int(top_k), dtype=torch.int64, device=device),
            torch.full((B,), float(top_p), device=device))


# ---------------------------------------------------------------------- other revisions
#: The repository this folder belongs to.
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extract_revision(revision: str, folder: str, *paths: str) -> None:
    """The files under ``paths`` (relative to the repository) at git ``revision``, written
    into ``folder`` under the same relative paths (``git archive``)."""
    os.makedirs(folder, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPOSITORY, "archive", revision, *paths],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
