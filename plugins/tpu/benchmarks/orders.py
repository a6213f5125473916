"""What per-request filter orders and the stateful selectors cost on the tpu backend
(docs/tpu.md, "Filter orders and stateful selectors"): warm-up with and without traced orders
and selectors (graphs compiled, seconds), then step time (``sample`` + ``append``) paired in
rounds on one warm process, as ratios against the default order on a sampler that traces no
order.

    PJRT_DEVICE=CPU .venv-xla/bin/python plugins/tpu/benchmarks/orders.py --vocab 32000 --rows 8 32

Cases per row count (every row random, seeded, top-k 40, top-p 0.9, temperature 0.8):
``default``: the default order on a sampler without orders (the graph of earlier releases);
``default, 2 orders traced``: the same batch on a sampler warmed with two orders, which no
row uses; ``half custom``: half the rows run ``sampler_order`` top_k, top_p, temperature;
``all custom``: every row does; ``mirostat``: every row adds mirostat v2 (the selector graph,
and the append that advances its state).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from corelib import SamplingParams

from corelib_tpu.sampler import TpuSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired import paired_steps, report  # noqa: E402

ORDERS = [["top_k", "top_p", "temperature"], "temperature_last"]
BASE = dict(top_k=40, top_p=0.9, temperature=0.8)
CUSTOM = dict(BASE, sampler_order=["top_k", "top_p", "temperature"])


def _warm(device, rows: int, vocab: int, **kwargs):
    sampler = TpuSampler(device, buckets=(rows,), max_rows=rows)
    report = sampler.warmup(vocab, **kwargs)
    return sampler, report


def _batch(sampler: TpuSampler, rows: int, vocab: int, custom: int, **extra):
    batch = sampler.new_batch(vocab)
    for i in range(rows):
        params = CUSTOM if i < custom else BASE
        batch.add(f"r{i}", SamplingParams(seed=i, **params, **extra))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    import torch_xla
    device = torch_xla.device()
    V = args.vocab
    for rows in args.rows:
        plain, r_plain = _warm(device, rows, V, selectors=False)
        with_sel, r_sel = _warm(device, rows, V)
        ordered, r_ord = _warm(device, rows, V, orders=ORDERS)
        print(f"== V {V}, bucket {rows}: warm-up graphs / seconds / step graphs")
        for name, r in (("no selectors, no orders", r_plain), ("selectors (default)", r_sel),
                        ("selectors + 2 orders", r_ord)):
            print(f"  {name:26s} {r.graphs:4d} graphs {r.seconds:7.1f} s  "
                  f"sample graphs {r.step_graphs[('sample', rows)]}")
        cases = {
            "default": (with_sel, _batch(with_sel, rows, V, 0)),
            "default, 2 orders traced": (ordered, _batch(ordered, rows, V, 0)),
            "half custom": (ordered, _batch(ordered, rows, V, rows // 2)),
            "all custom": (ordered, _batch(ordered, rows, V, rows)),
            "mirostat": (with_sel, _batch(with_sel, rows, V, 0, mirostat_tau=3.0)),
        }
        gen = torch.Generator().manual_seed(0)
        logits = [(torch.randn((rows, V), generator=gen) * 3).to(device) for _ in range(4)]
        times, compiled = paired_steps(cases, logits, args.rounds, (with_sel, ordered))
        report(times, "default", args.rounds, compiled)

if __name__ == "__main__":
    main()
