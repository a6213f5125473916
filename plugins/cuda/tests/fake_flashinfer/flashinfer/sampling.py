"""FlashInfer 0.7.4's sampling entry points as the cuda backend uses them, in torch, for tests.

Read from flashinfer/sampling.py (wrappers, argument checks), csrc/sampling.cu (CHECK_INPUT:
contiguous inputs on the device of the first one) and include/flashinfer/sampling.cuh (the
kernels): same parameters and defaults as the real functions, the same checks, the same
results in distribution and on degenerate rows:

- ``sampling_from_logits``: a Gumbel race; NaN never wins; a row without a finite winner
  (every logit -inf or NaN) gives token 0;
- ``top_p_sampling_from_probs``: draws among the tokens t with ``sum(p > p_t) < top_p``; a
  row with no positive probability (all zero, or NaN after a softmax of +inf logits) gives
  output 0 and ``valid`` False (returned only with ``return_valid=True``);
- ``top_k_mask_logits``: keeps logits >= the k-th largest (ties kept; k >= V keeps the row);
- ``top_k_top_p_sampling_from_logits``: (the default ``top_k_first`` order without the fast
  path) ``top_k_mask_logits``, softmax, ``top_p_sampling_from_probs`` without ``valid``: a
  degenerate row comes back as token 0 with nothing to say so;
- ``chain_speculative_sampling``: draft i passes when ``u * q(d) < p(d)``; at the first
  failure one draw from ``relu(p - q)`` (p at the bonus slot), -1 when that is all zero,
  -1 after; the emitted count added into the tensor passed in.

Every call is appended to ``CALLS`` as (name, arguments) so tests can see which entry point
ran with what. Random numbers come from torch's global generator (tests seed it), never from
the seed/offset tensors (reading them would be a host read).
``FAKE_FLASHINFER_FAIL=abort`` makes every kernel abort the process (as an illegal memory
access takes a CUDA context down), ``=bad_ids`` makes them return out-of-range ids.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

CALLS: list = []


def _record(name: str, **arguments) -> None:
    CALLS.append((name, arguments))
    mode = os.environ.get("FAKE_FLASHINFER_FAIL")
    if mode == "abort":
        os.abort()


def _bad(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.full_like(ids, vocab_size + 7) if os.environ.get("FAKE_FLASHINFER_FAIL") == "bad_ids" else ids


def _check_input(name: str, t: torch.Tensor, reference: torch.Tensor) -> None:
    """csrc's CHECK_INPUT (contiguous, on the device) and CHECK_DEVICE."""
    if not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")
    if t.device != reference.device:
        raise RuntimeError(f"{name} must be on {reference.device}, got {t.device}")


def _check_seed_offset(seed, offset, device, batch_size: int) -> None:
    """sampling.py's _validate_and_convert_seed_offset."""
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError("seed and offset must both be tensors or both be scalars")
    for name, t in (("seed", seed), ("offset", offset)):
        if isinstance(t, torch.Tensor):
            if t.device != device:
                raise ValueError(f"{name} tensor must be on {device}")
            if t.dtype not in (torch.int64, torch.uint64) or t.ndim != 1 or t.size(0) not in (1, batch_size):
                raise ValueError(f"{name} tensor must be int64/uint64, 1D, of length 1 or {batch_size}")


def sampling_from_logits(
    logits: torch.Tensor,
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
    seed: Optional[Union[int, torch.Tensor]] = None,
    offset: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    _record("sampling_from_logits", logits=logits, seed=seed, offset=offset)
    _check_input("logits", logits, logits)
    _check_seed_offset(seed, offset, logits.device, logits.shape[0])
    u = torch.rand(logits.shape, generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
    keys = logits.float() - torch.log(-torch.log(u))
    keys = torch.where(torch.isnan(keys), float("-inf"), keys)
    ids = torch.argmax(keys, dim=-1)
    won = keys.gather(1, ids[:, None])[:, 0] > float("-inf")
    return _bad(torch.where(won, ids, 0).to(torch.int32), logits.shape[-1])


def top_p_sampling_from_probs(
    probs: torch.Tensor,
    top_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
    seed: Optional[Union[int, torch.Tensor]] = None,
    offset: Optional[Union[int, torch.Tensor]] = None,
    return_valid: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    _record("top_p_sampling_from_probs", probs=probs, top_p=top_p, seed=seed, offset=offset,
            return_valid=return_valid)
    _check_input("probs", probs, probs)
    _check_seed_offset(seed, offset, probs.device, probs.shape[0])
    p = probs.float()
    B, V = p.shape
    top_p = torch.as_tensor(top_p, dtype=torch.float32).expand(B)
    ascending = torch.sort(torch.nan_to_num(p, nan=0.0), dim=-1).values
    prefix = torch.cat([torch.zeros(B, 1), ascending.cumsum(dim=-1)], dim=1)     # mass of the i smallest
    at_most = torch.searchsorted(ascending, torch.nan_to_num(p, nan=0.0).contiguous(), right=True)
    greater = prefix[:, -1:] - prefix.gather(1, at_most)                          # sum(p > p_t)
    kept = (p > 0) & (greater < top_p[:, None])
    valid = kept.any(dim=-1)
    weights = torch.where(kept, p, 0.0)
    weights[~valid] = 1.0
    ids = torch.multinomial(weights, 1, generator=generator)[:, 0]
    ids = _bad(torch.where(valid, ids, 0).to(torch.int32), V)
    return (ids, valid) if return_valid else ids


def top_k_mask_logits(logits: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    _record("top_k_mask_logits", logits=logits, top_k=top_k)
    _check_input("logits", logits, logits)
    V = logits.shape[-1]
    k = torch.as_tensor(top_k).to(torch.long).expand(logits.shape[0])
    ordered = torch.sort(logits, dim=-1, descending=True).values
    kth = ordered.gather(1, (k.clamp(1, V) - 1)[:, None])
    keep = (logits >= kth) | (k >= V)[:, None]
    return logits.masked_fill(~keep, float("-inf"))


def top_k_top_p_sampling_from_logits(
    logits: torch.Tensor,
    top_k: Union[torch.Tensor, int],
    top_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
    seed: Optional[Union[int, torch.Tensor]] = None,
    offset: Optional[Union[int, torch.Tensor]] = None,
    top_k_max: Optional[int] = None,
) -> torch.Tensor:
    _record("top_k_top_p_sampling_from_logits", logits=logits, top_k=top_k, top_p=top_p,
            seed=seed, offset=offset, top_k_max=top_k_max)
    masked = top_k_mask_logits(logits, top_k)
    CALLS.pop()                                     # an internal call of this entry point
    probs = torch.softmax(masked, dim=-1)
    ids = top_p_sampling_from_probs(probs, top_p, indices, deterministic, generator=generator,
                                    seed=seed, offset=offset)
    CALLS.pop()
    return ids


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    seed: Optional[Union[int, torch.Tensor]] = None,
    offset: Optional[Union[int, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _record("chain_speculative_sampling", draft_probs=draft_probs, draft_token_ids=draft_token_ids,
            target_probs=target_probs, seed=seed, offset=offset)
    for name, t in (("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids),
                    ("target_probs", target_probs)):
        _check_input(name, t, draft_probs)
    if draft_probs.dim() != 3 or draft_token_ids.dim() != 2 or target_probs.dim() != 3:
        raise RuntimeError("chain_speculative_sampling: draft_probs [B, K, V], draft_token_ids "
                           "[B, K], target_probs [B, K + 1, V]")
    B, K, V = draft_probs.shape
    if tuple(draft_token_ids.shape) != (B, K) or tuple(target_probs.shape) != (B, K + 1, V):
        raise RuntimeError("chain_speculative_sampling: shapes disagree")
    _check_seed_offset(seed, offset, draft_probs.device, B)
    accepted = maybe_output_accepted_token_num
    emitted = maybe_output_emitted_draft_token_num
    if accepted is None:
        accepted = torch.zeros(B, dtype=torch.int32)
    if emitted is None:
        emitted = torch.zeros(B, dtype=torch.int32)
    q, p = draft_probs.float(), target_probs.float()
    ids = draft_token_ids.long()
    rows = torch.arange(B)
    out = torch.full((B, K + 1), -1, dtype=torch.int32)
    u = torch.rand((B, K), generator=generator)
    slot = torch.arange(K)
    q_d = q[rows[:, None], slot[None, :], ids]
    p_d = p[rows[:, None], slot[None, :], ids]
    passes = (u * q_d < p_d).to(torch.int32)
    pos = torch.cumprod(passes, dim=1).sum(dim=1)                                 # first failure
    out[:, :K] = torch.where(slot[None, :] < pos[:, None], ids, -1).to(torch.int32)
    q_pos = torch.cat([q, torch.zeros(B, 1, V)], dim=1)[rows, pos]
    residual = (p[rows, pos] - q_pos).clamp(min=0)
    has_mass = residual.sum(dim=-1) > 0
    residual[~has_mass] = 1.0
    drawn = torch.multinomial(residual, 1, generator=generator)[:, 0]
    out[rows, pos] = torch.where(has_mass, drawn, -1).to(torch.int32)
    accepted += passes.sum(dim=1).to(accepted.dtype)
    emitted += pos.to(emitted.dtype)
    return _bad(out, V) if os.environ.get("FAKE_FLASHINFER_FAIL") == "bad_ids" else out, accepted, emitted
