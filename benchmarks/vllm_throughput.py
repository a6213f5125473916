"""vLLM generation throughput with corelib's sampler vs vLLM's own, on vLLM's CPU engine.

Runs in the vLLM venv (``bash scripts/test.sh`` or ``ensure_vllm_venv`` in scripts/lib.sh):

    .venv-vllm/bin/python benchmarks/vllm_throughput.py [--requests 32] [--tokens 64]
        [--vocab 512] [--repeats 5] [--csv out.csv]

Both engines run in this process on the same tiny random Llama (tests/integrations/vllm/
tiny_llama.py), with the same settings; only the sampler differs (``CORELIB_VLLM=cpu`` or
unset while the engine starts). Each repeat submits ``--requests`` requests at once
(max_num_seqs = requests) that each generate ``--tokens`` tokens, alternating the two
engines so machine noise hits both alike. Reported: generated tokens per second (median),
the ratio corelib / vLLM, and the sampler's share of an engine step. Throughput is the batch
size over the median time of the steps in which all requests decode (``execute_model``
through ``sample_tokens`` on the model runner); the sampler's ``forward`` is timed inside the
same steps. Medians, because other processes on a shared machine make wall-clock totals
jump; the wall-clock rate is printed as well.

One torch thread (``--threads``), not pinned to a core (``VLLM_CPU_OMP_THREADS_BIND=nobind``
unless set), the same for both engines.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "random": dict(temperature=1.0),
    "top-k/top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                      frequency_penalty=0.2, presence_penalty=0.2),
}


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
    end) and the sampler's ``forward`` inside it, keeping the steps where every request of
    the batch was decoding (``rows`` rows)."""

    def __init__(self, runner, rows: int):
        self.rows = rows
        self.steps: list[float] = []
        self.sampler: list[float] = []
        self._start = self._sampled = 0.0
        execute, sample_tokens, forward = runner.execute_model, runner.sample_tokens, runner.sampler.forward

        def timed_execute(*args, **kwargs):
            self._start = time.perf_counter()
            return execute(*args, **kwargs)

        def timed_forward(logits, *args, **kwargs):
            start = time.perf_counter()
            out = forward(logits, *args, **kwargs)
            self._sampled = time.perf_counter() - start if logits.shape[0] == self.rows else -1.0
            return out

        def timed_sample_tokens(*args, **kwargs):
            self._sampled = -1.0
            out = sample_tokens(*args, **kwargs)
            if self._sampled >= 0:
                self.steps.append(time.perf_counter() - self._start)
                self.sampler.append(self._sampled)
            return out
        runner.execute_model, runner.sample_tokens = timed_execute, timed_sample_tokens
        runner.sampler.forward = timed_forward

    def reset(self) -> None:
        self.steps, self.sampler = [], []


def make_engine(model_dir: Path, backend, requests: int):
    from vllm import LLM
    previous = os.environ.pop("CORELIB_VLLM", None)
    if backend is not None:
        os.environ["CORELIB_VLLM"] = backend
    try:
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                  max_num_seqs=requests, seed=0, skip_tokenizer_init=True)
    finally:
        os.environ.pop("CORELIB_VLLM", None)
        if previous is not None:
            os.environ["CORELIB_VLLM"] = previous
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    print(f"engine with CORELIB_VLLM={backend}: sampler {type(runner.sampler).__name__}")
    return llm, StepTimer(runner, requests)


def run_once(llm, timer, prompts, params) -> dict:
    """One generate call: wall-clock tokens/s, and the median full-batch step and sampler
    time (medians resist the bursts of other processes on a shared machine)."""
    timer.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step, sampler = statistics.median(timer.steps), statistics.median(timer.sampler)
    return dict(wall_tokens_per_s=tokens / elapsed, tokens_per_s=timer.rows / step,
                step_ms=1e3 * step, sampler_ms=1e3 * sampler, sampler_share=sampler / step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)

    _setup_environment()
    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))
    import tiny_llama
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    tiny_llama.make_model(model_dir, vocab_size=args.vocab)
    engines = {"vllm": make_engine(model_dir, None, args.requests),
               "corelib-cpu": make_engine(model_dir, "cpu", args.requests)}
    prompts = [TokensPrompt(prompt_token_ids=[1] + [(7 * i + j) % (args.vocab - 3) + 3
                                                    for j in range(8 + i % 8)])
               for i in range(args.requests)]
    rows = []
    for workload, options in WORKLOADS.items():
        params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i, **options)
                  for i in range(args.requests)]
        results = {name: [] for name in engines}
        for name, (llm, timer) in engines.items():   # warm-up
            run_once(llm, timer, prompts, params)
        for _ in range(args.repeats):
            for name, (llm, timer) in engines.items():
                results[name].append(run_once(llm, timer, prompts, params))
        medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in results.items()}
        for name, m in medians.items():
            rows.append(dict(workload=workload, sampler=name, vocab=args.vocab,
                             requests=args.requests, tokens=args.tokens, **m,
                             ratio=m["tokens_per_s"] / medians["vllm"]["tokens_per_s"]))
    print(f"vLLM CPU engine, tiny Llama (vocab {args.vocab}), {args.requests} concurrent requests x "
          f"{args.tokens} tokens, {torch.get_num_threads()} torch thread(s), median of {args.repeats}")
    print(f"{'workload':<12} {'sampler':<12} {'tokens/s':>9} {'vs vLLM':>8} {'step ms':>8} "
          f"{'sampler ms':>11} {'share':>6} {'wall tokens/s':>14}")
    for r in rows:
        print(f"{r['workload']:<12} {r['sampler']:<12} {r['tokens_per_s']:>9.0f} {r['ratio']:>8.2f} "
              f"{r['step_ms']:>8.2f} {r['sampler_ms']:>11.3f} {100 * r['sampler_share']:>5.1f}% "
              f"{r['wall_tokens_per_s']:>14.0f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
