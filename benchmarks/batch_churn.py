"""What requests joining and leaving cost the core's batch, against another git revision: the
host work an engine pays between steps (``add``, ``remove``, the flags the next step reads,
the first step state after a join, the ``append`` after it, and a new batch of one request
with its first state, for a caller that makes a batch per call).

The other revision's ``corelib`` is extracted with ``git archive`` into a temporary folder and
run in a second interpreter (two versions of one package cannot share a process); the two
interpreters run one after the other, ``--rounds`` times, so take the ratios of one run only.
Times are the calling thread's CPU time (one torch thread), medians over the requests.

    python benchmarks/batch_churn.py --base f996ed1
    python benchmarks/batch_churn.py --base main --rows 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from harness import REPOSITORY, extract_revision

MEASURE = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import corelib
from corelib import SamplingParams
rows = int(sys.argv[2])
batch = corelib.Sampler().new_batch(512)
params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(rows)]
for i in range(rows):
    batch.add(f"r{i}", params[i])

def clock(fn):
    start = time.thread_time_ns(); fn(); return (time.thread_time_ns() - start) / 1e3

def median(xs):
    xs = sorted(xs); return xs[len(xs) // 2]

def new_batch_of_one():
    one = corelib.Sampler().new_batch(512)
    one.add("one", params[0])
    one.step_state()

flags, removes, adds, states, appends, fresh = [], [], [], [], [], []
ids = torch.arange(rows) % 512
for _ in range(5):
    for i in range(rows):
        removes.append(clock(lambda: batch.remove(f"r{i}")))
        adds.append(clock(lambda: batch.add(f"r{i}", params[i])))
        states.append(clock(batch.step_state))
        appends.append(clock(lambda: batch.append(ids)))
        if i % 8 == 0:
            fresh.append(clock(new_batch_of_one))
    for _ in range(50):
        batch._changed()
        flags.append(clock(batch._compute_flags))
print("RESULT " + json.dumps({"flags": median(flags), "remove": median(removes), "add": median(adds),
                              "state": median(states), "append": median(appends),
                              "fresh": median(fresh)}))
"""


def measure(tree: str, rows: int) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, tree, str(rows)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.split("RESULT ")[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--rows", type=int, default=256, help="requests in the batch (n = 1 each)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        extract_revision(args.base, folder, "corelib")
        print(f"B = {args.rows} requests; us per call (thread CPU time), base {args.base} / this checkout")
        print("| round | flags after a change | remove | add | first step state after a join | "
              "append (after it) | new batch of one, its first state |")
        print("|---|---|---|---|---|---|---|")
        for r in range(args.rounds):
            base, current = measure(folder, args.rows), measure(REPOSITORY, args.rows)
            cells = [f"{base[k]:.0f} / {current[k]:.0f}" for k in ("flags", "remove", "add", "state", "append", "fresh")]
            print(f"| {r + 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
