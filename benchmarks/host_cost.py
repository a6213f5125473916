"""Host cost per step (issue 19): at V = 512 the logits cost nothing, so what a step costs is
the Python and the small tensor operations around them.

Times one ``sample`` + ``append`` step of the ``cpu`` backend (``corelib.get_sampler("cpu")``)
and of the ``cuda`` backend's torch path on CPU tensors (``CudaSampler("cpu",
use_flashinfer=False)``) against one call of vLLM's own ``vllm.v1.sample.sampler.Sampler``
for the same configuration, in the same process, the calls interleaved step by step (so load
from other processes hits all of them alike), for B = 32 and B = 256:

- plain: temperature 1.0;
- top-k 50 + top-p 0.9;
- penalties: repetition 1.1, frequency 0.2, presence 0.2 (a 32-token prompt per row);
- seeded: temperature 1.0, every row with a seed (vLLM: a generator per row);
- logprobs 5: temperature 1.0, the top-5 and the sampled token's logprob.

Every sampler runs a decode loop (the tokens drawn are appended, so seeded positions and
penalty histories move on; vLLM's output lists are extended outside its timing, as its model
runner does). The ratio is vLLM's median over corelib's: >= 1 means corelib is no slower.

It also times the vLLM adapter's own per-step work, ``BatchMirror.sync`` (corelib's batch
brought to the rows of vLLM's ``InputBatch``), at steady state, with one request leaving
and one joining every step, and with B requests joining an empty batch at once and leaving it
at once. Without vLLM only the corelib samplers are timed.

    python benchmarks/host_cost.py                                  # main venv: corelib alone
    .venv-vllm/bin/python benchmarks/host_cost.py                   # with vLLM: the ratios
    .venv-vllm/bin/python benchmarks/host_cost.py --steps 400 --batch-sizes 32
    python benchmarks/host_cost.py --profile penalties:32           # cProfile of the cpu step
    python benchmarks/host_cost.py --digest                         # seeded tokens' digest

``--digest`` prints a hash of the tokens every seeded configuration draws over the steps (a
change in a seeded token changes it): compare it between revisions.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import cProfile
import hashlib
import io
import pstats
import statistics
import sys
from typing import Callable

import torch

import corelib
from corelib import SamplingParams
from corelib.bench import machine_description, make_logits
from harness import add_clock_argument, clock_from, load_average, load_vllm, timed_call, vllm_metadata

V = 512
BATCH_SIZES = (32, 256)
PROMPT = 32
# name -> corelib SamplingParams fields (a seed is added per row for "seeded")
CONFIGS: dict[str, dict] = {
    "plain": dict(temperature=1.0),
    "top-k 50 + top-p 0.9": dict(top_k=50, top_p=0.9),
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
    "seeded": dict(temperature=1.0),
    "logprobs 5": dict(temperature=1.0, logprobs=5),
}
SHORT = {"plain": "plain", "top-k 50 + top-p 0.9": "topk_topp", "penalties": "penalties",
         "seeded": "seeded", "logprobs 5": "logprobs"}


def prompt_of(i: int) -> list[int]:
    return [(7 * i + 3 * j) % V for j in range(PROMPT)]


def row_params(name: str, i: int) -> SamplingParams:
    fields = dict(CONFIGS[name])
    if name == "seeded":
        fields["seed"] = 100_003 + i
    return SamplingParams(**fields)


# ---------------------------------------------------------------------- the corelib steps
def corelib_step(sampler, name: str, B: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function doing one ``sample`` + ``append`` on a batch of B rows of config ``name``;
    returns the tokens."""
    batch = sampler.new_batch(V)
    for i in range(B):
        batch.add(f"req-{i}", row_params(name, i), prompt_token_ids=prompt_of(i))

    def step(logits):
        out = sampler.sample(logits, batch)
        batch.append(out.token_ids)
        return out.token_ids
    return step


def cuda_sampler():
    """The cuda backend's torch path on CPU tensors, or None when the plugin is missing."""
    try:
        from corelib_cuda import CudaSampler
    except Exception as exc:
        print(f"corelib_cuda is not importable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return CudaSampler("cpu", use_flashinfer=False)


# ---------------------------------------------------------------------- vLLM's sampler
def vllm_step(vllm, name: str, B: int):
    """(one call of vLLM's Sampler on a copy of the logits, the runner's bookkeeping after it):
    the metadata as vLLM's input batch builds it for B requests of config ``name``."""
    params = CONFIGS[name]
    seeds = [100_003 + i for i in range(B)] if name == "seeded" else None
    outputs: list[list[int]] = [[] for _ in range(B)]
    metadata = vllm_metadata(vllm, B, params, seeds=seeds,
                             prompts=[prompt_of(i) for i in range(B)], outputs=outputs)
    sampler = vllm.Sampler()
    buffer = torch.empty((B, V))

    def prepare(logits):
        buffer.copy_(logits)          # vLLM's sampler works in place on its input

    def step(_logits):
        return sampler(buffer, metadata).sampled_token_ids

    def after(tokens):                # the runner appends the tokens (not timed)
        for row, token in enumerate(tokens.view(-1).tolist()):
            outputs[row].append(token)
    return prepare, step, after


# ---------------------------------------------------------------------- the timing loop
def bench_samplers(name: str, B: int, steps: int, vllm, clock) -> dict:
    """Median ms per step of every sampler, interleaved step by step."""
    logits_pool = [make_logits(B, V, "flat", seed=s) for s in range(8)]
    contenders: dict[str, tuple] = {}
    contenders["cpu"] = (None, corelib_step(corelib.get_sampler("cpu"), name, B), None)
    cuda = cuda_sampler()
    if cuda is not None:
        contenders["cuda (torch path)"] = (None, corelib_step(cuda, name, B), None)
    if vllm is not None:
        contenders["vllm"] = vllm_step(vllm, name, B)
    times = {k: [] for k in contenders}
    for i in range(steps + 5):
        logits = logits_pool[i % len(logits_pool)]
        for key, (prepare, step, after) in contenders.items():
            if prepare is not None:
                prepare(logits)
            elapsed, tokens = timed_call(step, logits, clock=clock)
            if after is not None:
                after(tokens)
            if i >= 5:                          # warm-up steps
                times[key].append(elapsed)
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------------- the mirror
class MirrorBench:
    """A vLLM ``InputBatch`` with room for ``rows`` requests and corelib's mirror of it."""

    def __init__(self, rows: int):
        from vllm.v1.worker.gpu_input_batch import InputBatch

        from corelib.integrations.vllm.sampler import BatchMirror

        self.input_batch = InputBatch(max_num_reqs=rows, max_model_len=4096,
                                      max_num_batched_tokens=4096, device=torch.device("cpu"),
                                      vocab_size=V, block_sizes=[16], max_num_blocks_per_req=[8])
        self.requests: dict = {}
        self.mirror = BatchMirror(corelib.get_sampler("cpu"), V, "raw")
        self.counter = 0

    def new_request(self) -> str:
        from vllm import SamplingParams as VllmParams
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        i = self.counter
        self.counter += 1
        rid = f"req-{i}"
        self.requests[rid] = CachedRequestState(
            req_id=rid, prompt_token_ids=prompt_of(i), mm_features=[],
            sampling_params=VllmParams(temperature=1.0, seed=1000 + i), generator=None,
            block_ids=([i],), num_computed_tokens=0, output_token_ids=[])
        self.input_batch.add_request(self.requests[rid])
        return rid

    def leave(self, rid: str) -> None:
        self.input_batch.remove_request(rid)
        del self.requests[rid]

    def timed_sync(self, clock) -> tuple[float, object]:
        """ms of ``sync`` and the step state built after it (the batch writes the rows of
        requests that joined when the state is next read), and the batch."""
        self.input_batch.condense()
        self.input_batch.refresh_metadata()
        return timed_call(self._sync, clock=clock)

    def _sync(self):
        batch = self.mirror.sync(self.input_batch, self.requests)
        batch.step_state()
        return batch


def bench_mirror_burst(B: int, rounds: int, clock) -> tuple[float, float]:
    """Median ms of the sync in which B requests join an empty batch at once, and of the one
    in which they all leave (a batch of prompts submitted together, finishing together)."""
    bench = MirrorBench(B)
    joins, leaves = [], []
    for _ in range(rounds + 1):
        rids = [bench.new_request() for _ in range(B)]
        joins.append(bench.timed_sync(clock)[0])
        for rid in rids:
            bench.leave(rid)
        leaves.append(bench.timed_sync(clock)[0])
    return statistics.median(joins[1:]), statistics.median(leaves[1:])


def bench_mirror(B: int, steps: int, churn: bool, clock) -> float:
    """Median ms of ``BatchMirror.sync`` per step for B requests of vLLM's InputBatch (one
    leaving and one joining every step when ``churn``), with the step state built after it."""
    bench = MirrorBench(B + 1)
    for _ in range(B):
        bench.new_request()
    bench.timed_sync(clock)
    times = []
    gen = torch.Generator().manual_seed(0)
    for i in range(steps + 5):
        if churn:
            bench.leave(bench.input_batch.req_ids[int(torch.randint(B, (1,), generator=gen))])
            bench.new_request()
        elapsed, batch = bench.timed_sync(clock)
        tokens = torch.randint(0, V, (len(batch),), generator=gen)
        batch.append(tokens)                               # the sampler's append (timed above)
        for row, rid in enumerate(bench.input_batch.req_ids):   # the runner keeps the tokens
            bench.requests[rid].output_token_ids.append(int(tokens[row]))
        if i >= 5:
            times.append(elapsed)
    return statistics.median(times)


# ---------------------------------------------------------------------- profile, digest
def profile(name: str, B: int, steps: int, top: int = 25) -> str:
    step = corelib_step(corelib.get_sampler("cpu"), name, B)
    logits = make_logits(B, V, "flat")
    for _ in range(5):
        step(logits)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(logits)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def digest(steps: int) -> str:
    """A hash of the tokens of seeded rows over ``steps`` steps, for every configuration
    (each with a seed per row here) and both batch sizes, on the cpu backend."""
    h = hashlib.sha256()
    for name in CONFIGS:
        for B in BATCH_SIZES:
            sampler = corelib.get_sampler("cpu")
            batch = sampler.new_batch(V)
            for i in range(B):
                fields = dict(CONFIGS[name], seed=100_003 + i)
                batch.add(f"req-{i}", SamplingParams(**fields), prompt_token_ids=prompt_of(i))
            for s in range(steps):
                out = sampler.sample(make_logits(B, V, "flat", seed=s % 8), batch)
                batch.append(out.token_ids)
                h.update(out.token_ids.numpy().tobytes())
                if out.logprobs is not None:
                    h.update(out.logprobs.logprobs.numpy().tobytes())
                    h.update(out.logprobs.token_ids.numpy().tobytes())
                    h.update(out.logprobs.ranks.numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per cell")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--configs", default=",".join(SHORT.values()),
                        help="comma-separated: " + ",".join(SHORT.values()))
    parser.add_argument("--threads", type=int, default=1)
    add_clock_argument(parser)
    parser.add_argument("--no-mirror", action="store_true", help="skip the adapter's sync")
    parser.add_argument("--profile", metavar="CONFIG:B", help="cProfile the cpu step")
    parser.add_argument("--digest", action="store_true", help="seeded tokens' digest")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = clock_from(args, parser, args.threads)
    if args.digest:
        print(digest(40))
        return 0
    if args.profile:
        short, B = args.profile.rsplit(":", 1)
        name = next(n for n, s in SHORT.items() if s == short)
        print(profile(name, int(B), args.steps))
        return 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = [n for n, s in SHORT.items() if s in args.configs.split(",")]
    vllm = load_vllm()
    print(f"{machine_description()}; {torch.get_num_threads()} torch thread(s); V = {V}; "
          f"median of {args.steps} steps ({args.clock} clock); load {load_average():.1f}")
    rows = []
    for name in names:
        for B in batch_sizes:
            rows.append((name, B, bench_samplers(name, B, args.steps, vllm, clock)))
    keys = list(rows[0][2])
    head = ["config", "B"] + [f"{k} ms" for k in keys]
    if "vllm" in keys:
        head += [f"vLLM / {k}" for k in keys if k != "vllm"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, B, t in rows:
        cells = [name, str(B)] + [f"{t[k]:.3f}" for k in keys]
        if "vllm" in t:
            cells += [f"{t['vllm'] / t[k]:.2f}" for k in keys if k != "vllm"]
        print("| " + " | ".join(cells) + " |")
    if vllm is not None and not args.no_mirror:
        print("\nvLLM adapter: BatchMirror.sync per step (ms), with the step state after it")
        print("| B | steady | one leaves, one joins | B join at once | B leave at once |")
        print("|---|---|---|---|---|")
        for B in batch_sizes:
            steady = bench_mirror(B, args.steps, False, clock)
            churn = bench_mirror(B, args.steps, True, clock)
            join, leave = bench_mirror_burst(B, max(5, args.steps // 30), clock)
            print(f"| {B} | {steady:.3f} | {churn:.3f} | {join:.3f} | {leave:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
