"""vLLM V1 logits processors for the tests (``vllm.v1.sample.logits_processor.LogitsProcessor``:
``update_state(BatchUpdate)``, ``apply(logits)``), each switched on per request through
``SamplingParams.extra_args``. Importable by name, so an engine in another process can load
them (``--logits-processors logits_processors:ForceToken``).

- ``ForceToken`` (``target_token``): the token vLLM's own test suite forces with its dummy
  processor; every other token -inf. Not argmax-invariant.
- ``BanRecent`` (``ban_recent``: k): bans the request's last k generated tokens, read from the
  live output-token list vLLM hands over when the request joins. Not argmax-invariant.
- ``KeepBest`` (``keep_best``: m): keeps the m most likely tokens, m shrinking by one per
  generated token down to 1. Argmax-invariant.
- ``Recorder``: changes nothing; records every BatchUpdate (argmax-invariant).
- ``FailBeforePenalties`` / ``FailAfterTemperature`` (``fail``: True): raise in ``apply``
  while a request asking for it is in the batch.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class PerRequest(LogitsProcessor):
    """A processor with one entry per batch row that asks for it (``setting`` in extra_args):
    the row index -> (setting, the request's live output-token list)."""

    setting = ""
    argmax_invariant = False

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[object, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return self.argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for row, params, _, output_ids in batch_update.added:
            value = (params.extra_args or {}).get(self.setting)
            if value is None:
                self.rows.pop(row, None)
            else:
                self.rows[row] = (value, output_ids)
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if entry_a is not None:
                self.rows[b] = entry_a
            if entry_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = entry_b


class ForceToken(PerRequest):
    setting = "target_token"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (token, _) in self.rows.items():
            kept = logits[row, token].item()
            logits[row] = float("-inf")
            logits[row, token] = kept
        return logits


class BanRecent(PerRequest):
    setting = "ban_recent"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (k, output_ids) in self.rows.items():
            recent = output_ids[-k:]
            if recent:
                logits[row, recent] = float("-inf")
        return logits


class KeepBest(PerRequest):
    setting = "keep_best"
    argmax_invariant = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (m, output_ids) in self.rows.items():
            keep = max(1, m - len(output_ids))
            cut = logits[row].topk(keep).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < cut, float("-inf"))
        return logits


class Recorder(LogitsProcessor):
    """Records (batch_size, removed, added as (row, prompt), moved) per update."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.updates: list[tuple] = []

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self.updates.append((
                batch_update.batch_size, sorted(batch_update.removed),
                [(row, tuple(prompt or ())) for row, _, prompt, _ in batch_update.added],
                [(a, b, d.name) for a, b, d in batch_update.moved]))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class FailBeforePenalties(PerRequest):
    setting = "fail"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows:
            raise RuntimeError("the processor's lookup table is gone")
        return logits


class FailAfterTemperature(FailBeforePenalties):
    setting = "fail_late"
    argmax_invariant = True


ALL = [ForceToken, BanRecent, KeepBest, Recorder, FailBeforePenalties, FailAfterTemperature]
