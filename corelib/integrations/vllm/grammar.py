"""Structured outputs: vLLM's grammar bitmask handed to corelib instead of applied to the logits.

vLLM's scheduler fills one packed int32 bitmask row (xgrammar's and llguidance's format,
``ceil(V / 32)`` words) per structured-output request, and with speculative decoding one per
verification slot of it (its scheduled drafts, then the bonus slot), in the order of
``grammar_output.structured_output_request_ids``. vLLM's V1 runner then calls
``apply_grammar_bitmask``, which moves those rows to the rows of the logits and masks the logits
in place, before the sampler runs.

For a runner that samples with corelib, ``routed_apply_grammar_bitmask`` replaces that call: the
rows go to the same logits rows (rows without a grammar get -1 words, which allow every token)
and the result goes to the runner's ``CorelibSampler``, which passes it to corelib as
``token_bitmask`` (per slot when it verifies drafts). The logits stay as the model made them, so
raw logprobs are the model's, before the grammar (the contract's step 1). A backend whose
``sample`` has no ``token_bitmask`` argument gets vLLM's in-place masking, as before corelib
had the argument.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

ALL_ALLOWED = -1   # a word of -1 allows its 32 tokens


def logits_row_bitmask(grammar_bitmask: np.ndarray, grammar_request_ids: list[str],
                       batch_request_ids: list[str], spec_tokens: dict[str, list[int]],
                       num_logits_rows: int, pin_memory: bool = False) -> torch.Tensor:
    """int32 ``[num_logits_rows, W]``: the scheduler's bitmask rows at the rows of the logits.

    grammar_bitmask: int32 ``[sum over grammar requests of (1 + drafts), W]``, request after
    request in ``grammar_request_ids`` order, a request's slots consecutive. The logits hold,
    for each row of vLLM's batch (``batch_request_ids``) in order, ``1 + drafts`` rows, drafts
    from ``spec_tokens`` (none without speculative decoding). Rows of requests without a grammar
    are all -1 words. Not in place; a new (optionally pinned) host tensor."""
    width = grammar_bitmask.shape[1]
    first_row: dict[str, int] = {}
    row = 0
    for request_id in batch_request_ids:
        first_row[request_id] = row
        row += 1 + len(spec_tokens.get(request_id, ()))
    if row != num_logits_rows:
        raise RuntimeError(f"the logits have {num_logits_rows} rows, but vLLM's batch and its "
                           f"scheduled drafts account for {row}")
    out = torch.full((num_logits_rows, width), ALL_ALLOWED, dtype=torch.int32,
                     pin_memory=pin_memory)
    rows = out.numpy()
    source = 0
    for request_id in grammar_request_ids:
        slots = 1 + len(spec_tokens.get(request_id, ()))
        start = first_row.get(request_id)
        # A request the scheduler filled a mask for but that is not in this batch has no row.
        if start is not None:
            rows[start:start + slots] = grammar_bitmask[source:source + slots]
        source += slots
    return out


def routed_apply_grammar_bitmask(vllm_apply: Callable,
                                 sampler_for: Callable[[Any], Optional[Any]]) -> Callable:
    """A replacement for vLLM's ``apply_grammar_bitmask(scheduler_output, grammar_output,
    input_batch, logits)``: for an input batch whose runner samples with corelib
    (``sampler_for(input_batch)`` is its ``CorelibSampler``), the sampler receives the bitmask
    at the logits' rows and the logits are left alone. Other runners, and corelib backends
    whose ``sample`` has no ``token_bitmask`` argument (written before it), get vLLM's own
    function, which masks the logits in place before corelib samples them."""
    from vllm.utils.torch_utils import PIN_MEMORY

    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        sampler = sampler_for(input_batch)
        if sampler is None or not sampler.takes_token_bitmask:
            return vllm_apply(scheduler_output, grammar_output, input_batch, logits)
        mask = logits_row_bitmask(
            grammar_output.grammar_bitmask, list(grammar_output.structured_output_request_ids),
            list(input_batch.req_ids), scheduler_output.scheduled_spec_decode_tokens,
            logits.shape[0], pin_memory=PIN_MEMORY and not logits.is_cpu)
        sampler.receive_grammar_bitmask(mask)
    apply_grammar_bitmask.__wrapped__ = vllm_apply
    return apply_grammar_bitmask
