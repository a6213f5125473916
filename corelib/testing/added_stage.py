"""A stage added to the stage table alone (``corelib.pipeline``), run on a backend: the proof
that a new built-in stage works on a backend the day it is added, with no edit anywhere but
the table, the stage's field and its reference method.

``run_added_stage(backend)`` starts a fresh interpreter that adds a throwaway stage, "cut-a"
(top-a's rule under another name: drop tokens with p < a * p_max**2, right after min-p), to
the table before the rest of corelib is loaded, builds ``backend`` and returns the kept sets of a few batches (rows that
move, a row whose top-k lets a backend divide only its candidates by the temperature).
``expected_kept()`` is the hand computation they must equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Optional

import torch

from .. import pipeline

LOGITS = [2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]
# logits where min-p (0.3) then cut-a (0.5) keeps less than cut-a then min-p
ORDER_LOGITS = [-1.13, 0.75, -1.78, -3.02, 0.74, 2.91, 1.88, 1.55]

SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys, torch, pydantic
    # the table module alone, before the package that derives the batch and step state from
    # it: as if pipeline.py itself had been edited
    path = sys.argv[1]
    spec = importlib.util.spec_from_file_location("corelib.pipeline", path)
    pipeline = sys.modules["corelib.pipeline"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)

    # a throwaway stage, "cut-a" (top-a's rule: drop tokens with p < a * p_max**2), right
    # after min-p: its table entry, its field on a request type of its own, its reference
    # method; nothing else
    cut_a = pipeline.Stage("11x", "cut_a", "apply_cut_a", "filter", pipeline.RANDOM_ROWS,
                           (pipeline.Switch("any_cut_a", lambda p: getattr(p, "cut_a", 0.0) > 0),),
                           (pipeline.Field("cut_a", torch.float32, 0.0,
                                           lambda p: getattr(p, "cut_a", 0.0)),))
    at = [s.name for s in pipeline.STAGES].index("min_p") + 1
    pipeline.STAGES = pipeline.STAGES[:at] + (cut_a,) + pipeline.STAGES[at:]
    pipeline.reindex()

    import corelib
    from corelib.params import SamplingParams
    from corelib.sampler import Sampler

    class Params(SamplingParams):
        cut_a: float = pydantic.Field(default=0.0, ge=0.0, le=1.0)

    def apply_cut_a(self, x, s):
        p = torch.softmax(x, dim=-1)
        cut = s.cut_a[:, None] * p.amax(dim=-1, keepdim=True) ** 2
        return x.masked_fill(p < cut, float("-inf"))
    Sampler.apply_cut_a = apply_cut_a

    if sys.argv[2] == "cuda-torch-path":       # the cuda backend's torch path, on CPU tensors
        from corelib_cuda import CudaSampler
        sampler = CudaSampler("cpu", use_flashinfer=False)
    else:
        sampler = corelib.get_sampler(sys.argv[2])
    batch = sampler.new_batch(8)
    batch.add("off", Params(temperature=1.0))
    batch.add("on", Params(temperature=1.0, cut_a=0.9, n=2, seed=3))
    # with a top-k, a backend may divide only the top-k candidates by the temperature: cut-a
    # runs before top-k and must see the divided row
    batch.add("cold", Params(temperature=0.5, top_k=4, cut_a=0.2, seed=4))
    logits = torch.tensor([%s]).repeat(4, 1).to(sampler.device)
    kept = torch.isfinite(sampler.processed_logits(logits, batch)).cpu()
    batch.remove("off")       # the rows move: the scalars move with them
    moved = torch.isfinite(sampler.processed_logits(logits[:3], batch)).cpu()
    solo = sampler.new_batch(8)      # every random row has a top-k here
    solo.add("cold", Params(temperature=0.5, top_k=4, cut_a=0.2, seed=4))
    alone = torch.isfinite(sampler.processed_logits(logits[:1], solo)).cpu()
    # min-p, then cut-a on what it left (renormalised): the other order keeps more here
    ordered = sampler.new_batch(8)
    ordered.add("min_p", Params(min_p=0.3, cut_a=0.5, seed=7))
    order = torch.isfinite(sampler.processed_logits(
        torch.tensor([%s]).to(sampler.device), ordered)).cpu()
    print("RESULT " + json.dumps({"kept": kept.tolist(), "moved": moved.tolist(),
                                  "alone": alone.tolist(), "order": order.tolist(),
                                  "flag": batch.step_state().any_cut_a}))
""") % (LOGITS, ORDER_LOGITS)


def run_added_stage(backend: str, timeout: float = 600, env: Optional[dict] = None) -> dict:
    """The kept sets of the throwaway stage's batches on ``backend`` (a name ``get_sampler``
    takes, or "cuda-torch-path": the cuda backend's torch path on CPU tensors), from a fresh
    interpreter: {"kept", "moved", "alone": lists of bool rows, "flag": the stage's switch}.
    Raises AssertionError with the interpreter's error when it fails."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, pipeline.__file__, backend],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ")[-1])


def expected_kept() -> dict:
    """What ``run_added_stage`` must return: cut-a (top-a's rule) by hand on the same logits."""
    logits = torch.tensor(LOGITS)
    probs = torch.softmax(logits, dim=0)
    hand = (probs >= 0.9 * probs.max() ** 2).tolist()
    assert hand.count(True) == 2                       # the cut drops something here
    cold = torch.softmax(logits / 0.5, dim=0)
    cold = ((cold >= 0.2 * cold.max() ** 2) & (torch.arange(8) < 4)).tolist()
    assert cold.count(True) == 3                       # cut-a, not top-k, makes the cut
    p = torch.softmax(torch.tensor(ORDER_LOGITS), dim=0)
    min_p = p >= 0.3 * p.max()
    q = torch.where(min_p, p, 0.0) / torch.where(min_p, p, 0.0).sum()
    order = (min_p & (q >= 0.5 * q.max() ** 2)).tolist()
    assert order.count(True) == 1                      # the other order would keep two
    return {"kept": [[True] * 8, hand, hand, cold],
            "moved": [cold, hand, hand],               # the last row filled the one that left
            "alone": [cold], "order": [order], "flag": True}
