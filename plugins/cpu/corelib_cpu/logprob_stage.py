"""Step 15 of the ``cpu`` backend, the logprobs, on a block of rows.

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`: the reference's values, the top-N and
the rank in one compiled pass, or by group maxima and sign arithmetic (``rowops``). Shapes:
``n`` rows of a block, ``V`` vocabulary, ``N`` logprobs asked for.
"""

from __future__ import annotations

import torch
from corelib import Logprobs, StepState
from corelib.sampler import NEG_INF

from . import kernels
from .block import Block
from .rowops import count_at_least, top_logprobs


class LogprobStage:
    """Step 15 of :class:`~corelib_cpu.sampler.CpuSampler` (which provides ``workspace``)."""

    def processed_source(self, x: Block, final: Block, s: StepState, normalise: bool = True) -> torch.Tensor:
        """The final distribution's logits of the block (greedy rows: step 8a's), float32
        [n, V]; its log_softmax when ``normalise``. A view of the block's copy."""
        out = final.materialize()
        return torch.log_softmax(out, dim=-1) if normalise else out

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 as the reference computes it (``Sampler.gather_logprobs``): the sampled
        token's value, the rank ``(x >= sampled).sum(-1)`` and the top-N of float32 [n, V]
        log-probabilities (int64 [n] ids); among equal values the top-N lists the lowest id
        first (N < V; ``rowops.top_logprobs``), whichever path. One compiled pass per row where
        numba runs (``kernels.top_and_rank``: the rank and the top-N together); else the
        top-N by group maxima and the rank by sign arithmetic (see ``rowops``). New tensors."""
        V = logprobs.shape[-1]
        if num_logprobs < V:
            found = kernels.top_and_rank(logprobs, token_ids, num_logprobs)
            if found is not None:
                return Logprobs(*found)
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (n, 1)
        # the compiled count needs no buffer (a take is two operator calls per step)
        buffer = None if kernels.wanted() else self.workspace.take("ranks", tuple(logprobs.shape))
        ranks = count_at_least(logprobs, sampled, buffer)
        ids, values = [safe], [sampled]
        available = min(num_logprobs, V)
        if available > 0:
            top, top_ids = top_logprobs(logprobs, available)
            ids.append(top_ids)
            values.append(top)
        if available < num_logprobs:  # a vocabulary smaller than N: pad with id -1, -inf
            missing = (logprobs.shape[0], num_logprobs - available)
            ids.append(torch.full(missing, -1, dtype=torch.long))
            values.append(torch.full(missing, NEG_INF))
        return Logprobs(torch.cat(ids, dim=1), torch.cat(values, dim=1), ranks)
