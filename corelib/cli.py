"""The ``corelib`` command: ``info``, ``bench`` and ``demo`` (also ``python -m corelib``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from . import __version__
from .registry import BackendUnavailableError, default_registry


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _words(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corelib", description="LLM token sampling backends.")
    parser.add_argument("--version", action="version", version=f"corelib {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="list discovered backends and the one auto-detection picks")
    info.add_argument("--json", action="store_true", help="print JSON for scripts")

    from .bench import CONFIGS
    bench = sub.add_parser(
        "bench", help="time a backend against the reference backend and one clone() of the logits",
        description="Times sampler.sample() for each config and batch size, with the reference "
                    "backend and one logits.clone() measured in the same run. 'speedup' = "
                    "reference time / backend time; 'passes' = backend time / clone time.")
    bench.add_argument("--backend", default=None, help="backend name (default: auto-detected)")
    bench.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32], help="e.g. 1,8,32")
    bench.add_argument("--vocab-sizes", type=_ints, default=[32000], help="e.g. 32000,128256")
    bench.add_argument("--configs", type=_words, default=["random", "top_k_top_p", "full"],
                       help=f"comma-separated, from: {', '.join(CONFIGS)}")
    bench.add_argument("--profiles", type=_words, default=["flat"], help="flat and/or peaked logits")
    bench.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median taken)")
    bench.add_argument("--no-reference", action="store_true", help="skip the reference timings")
    bench.add_argument("--csv", default=None, help="write the results to this CSV file")
    bench.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    bench.add_argument("--json", action="store_true", help="print JSON rows instead of a table")

    demo = sub.add_parser("demo", help="sample a few requests on the auto-detected backend, then a short bench")
    demo.add_argument("--backend", default=None, help="backend name (default: auto-detected)")
    demo.add_argument("--steps", type=int, default=8, help="decode steps to show")
    return parser


def cmd_info(args) -> int:
    registry = default_registry()
    statuses = registry.statuses()
    try:
        selected, _ = registry.choose(None)
        selected_name = selected.name
    except (BackendUnavailableError, ValueError) as exc:
        selected_name, error = None, str(exc)
    stages = registry.stage_statuses()
    if args.json:
        rows = [{**s.as_dict(), "selected": s.name == selected_name} for s in statuses]
        print(json.dumps({"corelib": __version__, "torch": torch.__version__,
                          "selected": selected_name, "backends": rows,
                          "stages": [s.as_dict() for s in stages]}, indent=2))
        return 0
    head = ["backend", "plugin", "distribution", "priority", "available", "auto-selected",
            "score grads", "details"]
    body = []
    for s in sorted(statuses, key=lambda s: -(s.priority if s.priority is not None else -10**9)):
        dist = f"{s.distribution or '?'} {s.version or ''}".strip()
        details = s.reason or s.description
        body.append([s.name, s.plugin, dist, "-" if s.priority is None else str(s.priority),
                     "yes" if s.available else "no", "<- selected" if s.name == selected_name else "",
                     s.score_gradients or "-", details])
    _print_table(head, body)
    print("\nscore grads: whose score runs when the logits require grad (own: the backend's, "
          "differentiable; reference: handed to the reference backend)")
    if selected_name is None:
        print(f"\nno backend is available: {error}")
    else:
        print(f"\ncorelib.get_sampler() -> {selected_name!r}")
    if stages:
        print()
        _print_table(["stage", "plugin", "distribution", "slot", "usable", "details"],
                     [[s.name, s.plugin, f"{s.distribution or '?'} {s.version or ''}".strip(),
                       s.slot or "-", "yes" if s.available else "no", s.reason or s.description]
                      for s in stages])
    return 0


def _print_table(head: list[str], body: list[list[str]]) -> None:
    """Columns padded to their widest cell; the last column is left ragged."""
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[-1])
    for row in body:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


def cmd_bench(args) -> int:
    from .bench import CONFIGS, format_table, machine_description, run_grid, write_csv, write_plot
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        print(f"corelib bench: unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    sampler = default_registry().get_sampler(args.backend)
    print(f"backend {sampler.name!r} on {sampler.device}; {machine_description()}", file=sys.stderr)
    rows = run_grid(sampler, args.configs, args.batch_sizes, args.vocab_sizes, args.profiles,
                    args.repeats, with_reference=not args.no_reference)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot:
        write_plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .bench import format_table, machine_description, run_grid
    from .params import SamplingParams
    sampler = default_registry().get_sampler(args.backend)
    print(f"corelib {__version__}: sampling on backend {sampler.name!r} ({sampler.device})")
    vocab = 50
    batch = sampler.new_batch(vocab_size=vocab, eos_token_id=0)
    batch.add("greedy", SamplingParams(temperature=0.0), prompt_token_ids=[5, 6, 7])
    batch.add("creative", SamplingParams(n=2, temperature=1.2, top_p=0.9, seed=42), prompt_token_ids=[5, 6, 7])
    batch.add("careful", SamplingParams(top_k=5, repetition_penalty=1.3, min_tokens=4, seed=7, logprobs=2),
              prompt_token_ids=[1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    tokens: dict = {key: [] for key in batch.rows}
    for _ in range(args.steps):
        logits = (torch.randn((len(batch), vocab), generator=gen) * 2).to(sampler.device)
        out = sampler.step(logits, batch)
        for key, token in zip(batch.rows, out.token_ids.cpu().tolist()):
            tokens[key].append(token)
    for (rid, child), ids in tokens.items():
        print(f"  {rid:>8} child {child}: {ids}")
    print(f"\nshort benchmark ({machine_description()}):")
    rows = run_grid(sampler, ["random", "top_k_top_p", "full"], [1, 8, 32], [32000], ["flat"], repeats=3)
    print(format_table(rows))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"info": cmd_info, "bench": cmd_bench, "demo": cmd_demo}
    try:
        return handlers[args.command](args)
    except (BackendUnavailableError, ValueError) as exc:
        print(f"corelib {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
