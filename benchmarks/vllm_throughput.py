"""vLLM generation throughput with corelib's sampler vs vLLM's own, on vLLM's CPU engine.

Runs in the vLLM venv (``bash scripts/test.sh`` or ``ensure_vllm_venv`` in scripts/lib.sh):

    .venv-vllm/bin/python benchmarks/vllm_throughput.py [--requests 32] [--tokens 64]
        [--vocab 512] [--repeats 5] [--speculative] [--seeding both] [--workloads ...]
        [--csv out.csv]

Both engines run in this process on the same tiny random Llama (tests/integrations/vllm/
tiny_llama.py), with the same settings; only the sampler differs (``CORELIB_VLLM=cpu`` or
unset while the engine starts). Each repeat submits ``--requests`` requests at once
(max_num_seqs = requests) that each generate ``--tokens`` tokens, alternating the two
engines so machine noise hits both alike. Every workload runs seeded (request i has seed i)
and unseeded (``--seeding``). Reported: generated tokens per second (median), the ratio
corelib / vLLM of the step rate and of whole ``generate()`` calls, and the sampler's time and
share of an engine step. Throughput is the batch
size over the median time of the steps in which all requests decode (``execute_model``
through ``sample_tokens`` on the model runner); the sampler's ``forward`` is timed inside the
same steps. Medians, because other processes on a shared machine make wall-clock totals
jump; the wall-clock rate is printed as well.

With ``--speculative`` both engines decode speculatively with vLLM's ngram drafter (3 drafts
per step, prompts that repeat a pattern so it finds proposals): vLLM's rejection sampler
against corelib's ``verify``. A step then emits a varying number of tokens per request, so
throughput is the generated tokens over the summed time of all steps; the verification is
timed per full-batch step, and the acceptance rate comes from vLLM's per-request metrics.
"repeats" (the share of generated tokens that repeat an earlier bigram of their sequence)
checks that verification keeps the text's distribution: both engines sample the same model
with the same parameters, so it should agree up to sampling noise.

One torch thread (``--threads``), not pinned to a core (``VLLM_CPU_OMP_THREADS_BIND=nobind``
unless set), the same for both engines.

With ``--base REV`` the script answers "did a change make corelib slower inside vLLM?": the
core and the cpu plugin of git revision REV are extracted with ``git archive`` into a temporary
folder, and the benchmark runs ``--rounds`` times for each tree, in separate interpreters (two
versions of one package cannot share a process), taking turns and swapping which goes first
each round. Each run measures corelib against vLLM's sampler in its own process, so what is
compared is that ratio, base against this checkout, per workload (medians over the rounds):

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --vocab 32000 --base 7c6cfaf --rounds 3 \
        --repeats 3 --seeding seeded
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "top-k/top-p": dict(temperature=1.0, top_k=50, top_p=0.95),
    "top-p": dict(temperature=1.0, top_p=0.9),
    "min-p": dict(temperature=1.0, min_p=0.05),
    "penalties": dict(temperature=1.0, top_p=0.9, repetition_penalty=1.1,
                      frequency_penalty=0.2, presence_penalty=0.2),
}


# No top_k: vLLM 0.32's own verification fails on it on the CPU (its CPU replacement for the
# Triton kernel that spreads per-request top_k over the draft slots yields bad indices).
SPECULATIVE_WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "top-p": dict(temperature=1.0, top_p=0.9),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def _setup_environment() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # No core pinning (a pinned thread waits whenever another process holds its core); one
    # torch thread, set before vLLM's worker takes torch.set_num_threads over.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # corelib's hooks are installed when vLLM loads its plugins (once per process) with
    # CORELIB_VLLM set; each engine then chooses by the variable's value while it starts.
    os.environ["CORELIB_VLLM"] = "cpu"
    from vllm.plugins import load_general_plugins
    load_general_plugins()


class StepTimer:
    """Times each engine step on the runner (``execute_model`` start to ``sample_tokens``
    end) and the sampler inside it (``sampler.forward``, or ``rejection_sampler`` when the
    engine speculates), keeping the sampler times of the steps where every request of the
    batch was decoding (``rows`` rows) and every step's time."""

    def __init__(self, runner, rows: int, speculative: bool = False):
        self.rows = rows
        self.steps: list[float] = []       # full-batch steps
        self.sampler: list[float] = []     # the sampler in those steps
        self.all_steps: list[float] = []   # every step
        self._start = self._sampled = 0.0
        execute, sample_tokens = runner.execute_model, runner.sample_tokens

        def timed_execute(*args, **kwargs):
            self._start = time.perf_counter()
            return execute(*args, **kwargs)

        def timed(call, rows_of):
            def timed_call(*args, **kwargs):
                start = time.perf_counter()
                out = call(*args, **kwargs)
                full = rows_of(*args, **kwargs) == self.rows
                self._sampled = time.perf_counter() - start if full else -1.0
                return out
            return timed_call

        def timed_sample_tokens(*args, **kwargs):
            self._sampled = -1.0
            out = sample_tokens(*args, **kwargs)
            elapsed = time.perf_counter() - self._start
            self.all_steps.append(elapsed)
            if self._sampled >= 0:
                self.steps.append(elapsed)
                self.sampler.append(self._sampled)
            return out
        runner.execute_model, runner.sample_tokens = timed_execute, timed_sample_tokens
        if speculative:
            runner.rejection_sampler = timed(runner.rejection_sampler,
                                             lambda metadata, *_: len(metadata.num_draft_tokens))
        else:
            runner.sampler.forward = timed(runner.sampler.forward, lambda logits, *_, **__: logits.shape[0])

    def reset(self) -> None:
        self.steps, self.sampler, self.all_steps = [], [], []


def make_engine(model_dir: Path, backend, requests: int, speculative: bool = False):
    from vllm import LLM
    previous = os.environ.pop("CORELIB_VLLM", None)
    if backend is not None:
        os.environ["CORELIB_VLLM"] = backend
    options = dict(speculative_config=NGRAM, per_request_spec_decode_metrics="summary") \
        if speculative else {}
    try:
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                  max_num_seqs=requests, seed=0, skip_tokenizer_init=True, **options)
    finally:
        os.environ.pop("CORELIB_VLLM", None)
        if previous is not None:
            os.environ["CORELIB_VLLM"] = previous
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    print(f"engine with CORELIB_VLLM={backend}: sampler {type(runner.sampler).__name__}"
          + (f", verification {type(runner.rejection_sampler).__name__}" if speculative else ""))
    return llm, StepTimer(runner, requests, speculative)


def run_once(llm, timer, prompts, params) -> dict:
    """One generate call: wall-clock tokens/s, and the median full-batch step and sampler
    time (medians resist the bursts of other processes on a shared machine). Speculating,
    throughput is the tokens over the summed step times, and the acceptance rate is added."""
    timer.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step, sampler = statistics.median(timer.steps), statistics.median(timer.sampler)
    result = dict(wall_tokens_per_s=tokens / elapsed, tokens_per_s=timer.rows / step,
                  step_ms=1e3 * step, sampler_ms=1e3 * sampler, sampler_share=sampler / step)
    metrics = [o.outputs[0].spec_decode_metrics for o in outs]
    if metrics[0] is not None:
        drafts = sum(m.num_draft_tokens for m in metrics)
        accepted = sum(j * n for m in metrics for j, n in enumerate(m.histogram))
        repeats = [repeated_bigrams(list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                   for o in outs]
        result.update(tokens_per_s=tokens / sum(timer.all_steps),
                      acceptance=accepted / max(drafts, 1),
                      repeats=statistics.mean(repeats))
    return result


def repeated_bigrams(prompt: list[int], output: list[int]) -> float:
    """The share of generated tokens that, with the token before them, repeat a bigram seen
    earlier in the sequence: a property of the text's distribution, which verification must
    not change (the same sampling parameters give the same value with and without
    speculation, up to sampling noise)."""
    sequence = prompt + output
    seen = {tuple(sequence[i - 1:i + 1]) for i in range(1, len(prompt))}
    hits = 0
    for i in range(len(prompt), len(sequence)):
        bigram = tuple(sequence[i - 1:i + 1])
        hits += bigram in seen
        seen.add(bigram)
    return hits / max(len(output), 1)


# The environment variable that points a child run at another revision's extracted tree.
TREE_VARIABLE = "CORELIB_BENCH_TREE"


def extract_revision(revision: str, folder: Path) -> Path:
    """``corelib`` and the cpu plugin's ``corelib_cpu`` of ``revision``, importable from
    ``folder``."""
    import harness
    harness.extract_revision(revision, str(folder), "corelib", "plugins/cpu/corelib_cpu")
    (folder / "plugins" / "cpu" / "corelib_cpu").rename(folder / "corelib_cpu")
    return folder


def _without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less the given options and their values (``--x V`` or ``--x=V``)."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in options:
            skip = True
        elif not token.startswith(tuple(option + "=" for option in options)):
            kept.append(token)
    return kept


def compare_with_base(args: argparse.Namespace, child_argv: list[str]) -> int:
    """Runs this script for the base tree and this checkout in turns (see the module
    docstring) and prints corelib's ratio to vLLM for each, per workload."""
    with tempfile.TemporaryDirectory() as folder:
        tree = extract_revision(args.base, Path(folder) / "tree")
        runs = {"base": [], "now": []}
        for round_ in range(args.rounds):
            order = ("base", "now") if round_ % 2 == 0 else ("now", "base")
            for side in order:
                out = Path(folder) / f"{side}-{round_}.csv"
                env = dict(os.environ)
                env.pop(TREE_VARIABLE, None)
                if side == "base":
                    env[TREE_VARIABLE] = str(tree)
                done = subprocess.run([sys.executable, __file__, *child_argv, "--csv", str(out)],
                                      env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stdout + done.stderr, file=sys.stderr)
                    return done.returncode
                with open(out) as f:
                    runs[side].append([r for r in csv.DictReader(f) if r["sampler"] != "vllm"])
        print(f"corelib-cpu / vLLM inside vLLM's CPU engine (vocab {args.vocab}, {args.requests} "
              f"requests x {args.tokens} tokens), base {args.base} against this checkout, medians "
              f"of {args.rounds} rounds of {args.repeats} repeats each")
        print("| workload | seeding | base: step ratio | now: step ratio | now / base | "
              "base: sampler ms | now: sampler ms |")
        print("|---|---|---|---|---|---|---|")
        for i, row in enumerate(runs["now"][0]):
            def median_of(side, key):
                return statistics.median(float(run[i][key]) for run in runs[side])
            base_ratio, now_ratio = median_of("base", "ratio"), median_of("now", "ratio")
            print(f"| {row['workload']} | {row['seeding']} | {base_ratio:.2f} | {now_ratio:.2f} | "
                  f"{now_ratio / base_ratio:.2f} | {median_of('base', 'sampler_ms'):.3f} | "
                  f"{median_of('now', 'sampler_ms'):.3f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative", action="store_true",
                        help="both engines speculate with ngram drafts (3 per step)")
    parser.add_argument("--seeding", choices=["both", "seeded", "unseeded"], default="both")
    parser.add_argument("--workloads", nargs="+", default=None,
                        help="a subset of the workloads (default: all)")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--base", help="a git revision to compare corelib's ratio with (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="with --base: runs of each tree")
    args = parser.parse_args(argv)
    if args.base:
        return compare_with_base(args, _without_options(sys.argv[1:] if argv is None else argv,
                                                        ("--base", "--rounds", "--csv")))
    tree = os.environ.get(TREE_VARIABLE)
    if tree:
        sys.path.insert(0, tree)

    _setup_environment()
    import corelib
    import corelib_cpu
    if tree and not all(Path(m.__file__).is_relative_to(tree) for m in (corelib, corelib_cpu)):
        raise RuntimeError(f"{TREE_VARIABLE}={tree}, but corelib was imported from {corelib.__file__}")
    import torch
    from harness import load_average, medians
    load_at_start = load_average()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))
    import tiny_llama
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    tiny_llama.make_model(model_dir, vocab_size=args.vocab)
    engines = {"vllm": make_engine(model_dir, None, args.requests, args.speculative),
               "corelib-cpu": make_engine(model_dir, "cpu", args.requests, args.speculative)}
    # vLLM's CPU worker set its own torch thread count while it started (in this process) and
    # replaced torch.set_num_threads with a no-op; the builtin in torch._C still works.
    torch._C.set_num_threads(args.threads)
    if args.speculative:
        # a pattern of 3-6 tokens, twice: the drafter finds its continuation in the prompt
        prompts = [TokensPrompt(prompt_token_ids=[1] + 2 * [(7 * i + j) % (args.vocab - 3) + 3
                                                            for j in range(3 + i % 4)])
                   for i in range(args.requests)]
    else:
        prompts = [TokensPrompt(prompt_token_ids=[1] + [(7 * i + j) % (args.vocab - 3) + 3
                                                        for j in range(8 + i % 8)])
                   for i in range(args.requests)]
    rows = []
    seedings = ("seeded", "unseeded") if args.seeding == "both" else (args.seeding,)
    workloads = SPECULATIVE_WORKLOADS if args.speculative else WORKLOADS
    chosen = [(name, seeding) for name in (args.workloads or workloads) for seeding in seedings]
    for workload, seeding in chosen:
        options = workloads[workload]
        params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                 seed=i if seeding == "seeded" else None, **options)
                  for i in range(args.requests)]
        results = {name: [] for name in engines}
        for name, (llm, timer) in engines.items():   # warm-up
            run_once(llm, timer, prompts, params)
        for _ in range(args.repeats):
            for name, (llm, timer) in engines.items():
                results[name].append(run_once(llm, timer, prompts, params))
        per_engine = {name: medians({key: [r[key] for r in runs] for key in runs[0]})
                      for name, runs in results.items()}
        for name, m in per_engine.items():
            rows.append(dict(workload=workload, seeding=seeding, sampler=name, vocab=args.vocab,
                             requests=args.requests, tokens=args.tokens, **m,
                             ratio=m["tokens_per_s"] / per_engine["vllm"]["tokens_per_s"],
                             wall_ratio=m["wall_tokens_per_s"] / per_engine["vllm"]["wall_tokens_per_s"]))
    print(f"vLLM CPU engine, tiny Llama (vocab {args.vocab}), {args.requests} concurrent requests x "
          f"{args.tokens} tokens, {torch.get_num_threads()} torch thread(s), median of {args.repeats}"
          + (", ngram speculation (3 drafts)" if args.speculative else "")
          + f"; load average {load_at_start:.2f} at start, {load_average():.2f} at end")
    print(f"{'workload':<12} {'seeding':<9} {'sampler':<12} {'tokens/s':>9} {'vs vLLM':>8} "
          f"{'step ms':>8} {'sampler ms':>11} {'share':>6} {'wall tokens/s':>14} {'wall vs vLLM':>13}"
          + (f" {'accepted':>9} {'repeats':>8}" if args.speculative else ""))
    for r in rows:
        print(f"{r['workload']:<12} {r['seeding']:<9} {r['sampler']:<12} {r['tokens_per_s']:>9.0f} "
              f"{r['ratio']:>8.2f} {r['step_ms']:>8.2f} {r['sampler_ms']:>11.3f} "
              f"{100 * r['sampler_share']:>5.1f}% {r['wall_tokens_per_s']:>14.0f} "
              f"{r['wall_ratio']:>13.2f}"
              + (f" {100 * r['acceptance']:>8.1f}% {100 * r['repeats']:>7.1f}%"
                 if args.speculative else ""))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
