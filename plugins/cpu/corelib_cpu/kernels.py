"""Optional compiled kernels (numba), each giving exactly the bits of the torch code it
replaces (but one, the unseeded candidate race, below), with that torch code as the
automatic fallback.

The kernels:

- the contract's seeded uniforms (``corelib.noise``), the integer hash of every (row key,
  token) pair, over whole rows or over each row's own token ids (a candidate row's), and
  the row keys themselves from their position-free part;
- the candidate races' winners: seeded, from torch's noise of the contract's uniforms (the
  reference's winner); unseeded, with noise of the kernel's own from one 64-bit key the
  sampler's generator draws per step (``unseeded_race_winners``). That one gives the torch
  race's distribution, not its tokens: unseeded rows promise no tokens (contract: the
  backend's own generator), and the torch noise was four operator calls of a B = 1 step.
  A seeded race is first settled from float64 estimates of its candidates' scores where one
  candidate's lies above every other's by more than their slacks
  (``seeded_candidates_settled``: the same bound as the whole-row search below, so the same
  winner), with no torch noise at all;
- the seeded race over whole rows (``seeded_race_candidates``): the tokens whose score can be
  the row's largest, found without the noise of most tokens. Each score is estimated in
  float64 within a proven bound of torch's float32 one, and a group's scores are bounded by
  its largest logit and its largest uniform (the noise rises with the uniform), so only the
  groups that can hold the winner are opened; the few candidates then race with torch's
  noise (the candidate race above), so the winner is the reference's token;
- the unseeded draw of a small vocabulary (``draw._draw_one_level``): one uniform per row
  through the float64 cumulative sum of the row's weights, in one call where torch makes
  twelve (at V = 512 the step is operator calls, not arithmetic);
- top-k and top-p on a row's few candidates (``select.top_k_candidates``'s tail and
  ``select.top_p_candidates_fast``): about thirty operator calls on ``[n, W]`` tensors,
  which is most of a step at B = 1, in two. Top-k divides and compares in float32, the same
  bits; top-p computes the candidates' softmax in float64 instead of float32, which only
  moves it closer to the exact values, so the error bound that proves a settled row's
  nucleus to be the reference's still holds (the kept candidates are the same);
- quadratic smoothing and adaptive-p's transform over whole rows (``smooth_rows``,
  ``adaptive_rows``): one pass in place where torch makes five to ten, each writing a row;
  float32 additions, products and quotients in the reference's order, none fused, so its
  bits;
- step 15's top-N and rank in one pass per row (``top_and_rank``): comparisons and integer
  counts only, so the same values and counts as torch's; the top-N's order among equal
  values is fixed (lowest id first) and the torch path (``rowops.top_logprobs``) keeps it.

In torch the hash is 13 operator calls, each a pass over ``[rows, V]`` that writes its result
to memory; compiled, it is one pass that keeps each value in a register. The hash is integer
arithmetic that wraps at 32 bits and the uniform ``(top 23 bits + 0.5) / 2**23`` is exact in
float32, so the compiled values equal torch's bit for bit. What follows the uniforms (two
logarithms) stays in torch, whose vectorised ``log`` a compiled loop would not reproduce to the
last bit. The draw's float64 sums run in token order, as torch's cumulative sum does.

Which path runs: numba when it is installed (the ``kernels`` extra of ``corelib-cpu``; vLLM
depends on it too) and ``CORELIB_CPU_KERNELS`` is not ``torch``; otherwise torch. ``corelib
info`` says which (``describe``). numba is imported on the first step that uses a kernel, not
before; its compiled code is cached on disk, so only the first process pays the compilation
(about a second).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Optional

from .kernel_bodies import compile_kernels

if TYPE_CHECKING:
    import torch

#: Environment variable: ``torch`` keeps every step on the pure-torch path.
KERNELS_ENV = "CORELIB_CPU_KERNELS"

_state: dict = {}


def _torch_only() -> Optional[str]:
    """Why the kernels' steps run in pure torch here, or None when numba serves them (no
    import of numba)."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "torch":
        return f"{KERNELS_ENV}=torch"
    if importlib.util.find_spec("numba") is None:
        return "numba not installed"
    return None


def wanted() -> bool:
    """Whether the compiled path is asked for and installable (no import of numba). Read
    once until ``reset``: a B = 1 step asks several times, and each answer reads the
    environment and the import system."""
    answer = _state.get("wanted")
    if answer is None:
        answer = _state["wanted"] = _torch_only() is None
    return answer


def describe() -> str:
    """Which path the kernels' steps take in this environment, for ``corelib info``."""
    reason = _torch_only()
    if reason is not None:
        return f"kernels: pure torch ({reason})"
    return ("kernels: numba (seeded noise and row keys, small-vocabulary draw, group maxima and top values of "
            "a few rows, min-p candidates, top-k/top-p/typical of candidates, steps 11-13a of a few rows in one "
            "call, candidate races (unseeded: their noise too; seeded: settled from float64 estimates where "
            "they can be), the seeded race's candidates over whole rows, "
            "logprobs (top-N and rank in one pass), "
            "quadratic smoothing, tail-free, adaptive-p, kept-set packing, nucleus histogram)")


def _compiled():
    """The compiled kernels (the uniforms of whole rows and of per-row ids, and the draw), or
    None (numba missing, refused, or failing to load)."""
    if "kernels" not in _state:
        _state["kernels"] = compile_kernels() if wanted() else None
    return _state["kernels"]


def seeded_uniforms_into(out: torch.Tensor, keys: torch.Tensor,
                         token_ids: Optional[torch.Tensor] = None, ids_array=None, out_array=None,
                         keys_array=None) -> bool:
    """``corelib.noise.uniform_noise(keys[:, None], token_ids)`` written into ``out`` by the
    compiled kernel: out float32 ``[n, W]`` contiguous, keys int32 ``[n]``, token_ids None
    (column j is token j: whole rows) or int64 ``[n, W]`` ids in ``[0, 2**31)`` (each row its
    own), all CPU tensors. The token's share of the hash is made in the kernel, so no
    ``token_offsets`` pass is needed. Returns False, writing nothing, when the compiled path
    does not run here (the caller then takes the torch path). ``ids_array``, ``out_array``:
    token_ids' and out's numpy views when the caller has them (contiguous); ``keys_array``
    the same for keys."""
    kernels = _compiled()
    if kernels is None or not out.is_contiguous():
        return False
    if out_array is None:
        out_array = out.numpy()
    if keys_array is None:
        keys_array = keys.contiguous().numpy()
    if token_ids is None:
        kernels["whole_rows"](keys_array, out_array)
    else:
        ids = token_ids.contiguous().numpy() if ids_array is None else ids_array
        kernels["per_row_ids"](keys_array, ids, out_array)
    return True


def row_keys_into(out: torch.Tensor, prefix: torch.Tensor, position: torch.Tensor,
                  arrays: Optional[tuple] = None) -> bool:
    """``corelib.noise.row_keys`` from its position-free part: out int32 ``[B]`` becomes
    ``mix32(prefix ^ position)`` (prefix, position int32 ``[B]``; integer arithmetic, the
    same bits) in one call where torch makes eight. Returns False, writing nothing, where the
    compiled path does not run. ``arrays``: the numpy views of (prefix, position, out) when
    the caller keeps them (each conversion is an operator call)."""
    kernels = _compiled()
    if kernels is None or not out.is_contiguous():
        return False
    if arrays is None:
        arrays = (prefix.contiguous().numpy(), position.contiguous().numpy(), out.numpy())
    kernels["mixed_keys"](*arrays)
    return True


def key_prefix(seed_lo: torch.Tensor, seed_hi: torch.Tensor, child: torch.Tensor):
    """``corelib.noise.row_key_prefix`` by the compiled kernel: int32 ``[B]`` from the rows'
    int32 ``[B]`` seed words and child numbers, in one call where torch makes about thirty on
    ``[B]`` (a plan made when requests join or leave pays them). Integer arithmetic, the same
    bits. None where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    out = torch.empty(seed_lo.shape[0], dtype=torch.int32)
    kernels["key_prefixes"](seed_lo.contiguous().numpy(), seed_hi.contiguous().numpy(),
                            child.contiguous().numpy(), out.numpy())
    return out


def positive_ids(weights: torch.Tensor, cap: int):
    """The ids of each row's positive weights, ascending: (ids int64 ``[n, cap]``, V - 1
    past a row's count, counts int64 ``[n]``) from weights float32 ``[n, V]``; False when a
    row has more than ``cap`` (it stops there); None where the compiled path does not run.
    One pass in which torch makes a comparison, a count and a nonzero."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n, V = weights.shape
    ids, counts = torch.empty((n, cap), dtype=torch.long), torch.empty(n, dtype=torch.long)
    bits = weights.contiguous().view(torch.int32).numpy()
    if not kernels["positive_ids"](bits, V - 1, ids.numpy(), counts.numpy()):
        return False
    return ids, counts


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``draw._draw_one_level`` by the compiled kernel: (int64 ``[n]`` ids, bool ``[n]`` ok)
    from weights float32 ``[n, V]`` (>= 0) and u float64 ``[n]`` or ``[n, 1]`` (the rows'
    uniforms), CPU tensors. The cumulative sums are torch's (float64, in token order), the
    target ``min(u * total, nextafter(total, 0))`` and the first sum above it the same, so
    the ids are too. None where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n = weights.shape[0]
    ids, ok = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.bool)
    kernels["inverse_cdf"](weights.contiguous().numpy(), u.reshape(-1).contiguous().numpy(),
                           ids.numpy(), ok.numpy())
    return ids, ok


def top_group_values(x: torch.Tensor, maxima: torch.Tensor, width: int, group: int):
    """``rowops.top_values``' group search by the compiled kernel, in one call where torch
    makes about eight: (values float32 ``[n, width]`` descending, ids int64 ``[n, width]``,
    floor float32 ``[n]``) from x float32 ``[n, V]``, its group maxima float32 ``[n, G]``
    (G > width) and the group size. The values are the row's ``width`` largest (torch.topk's:
    they all reach the ``width``-th largest group maximum, the floor, so they lie in the
    groups picked); among equal values the ids may come in another order, as the torch path
    allows. None where the compiled path does not run or a row holds a NaN."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous() or width >= maxima.shape[1]:
        return None
    import torch
    n = x.shape[0]
    values, ids = torch.empty((n, width)), torch.empty((n, width), dtype=torch.long)
    floor = torch.empty(n)
    if not kernels["top_group_values"](x.numpy(), maxima.contiguous().numpy(), group, values.numpy(),
                                       ids.numpy(), floor.numpy()):
        return None
    return values, ids, floor


def group_top_k(x: torch.Tensor, maxima: torch.Tensor, width: int, group: int, k: torch.Tensor,
                temperature: Optional[torch.Tensor]):
    """``select.top_k_candidates`` through the group search by one compiled call where
    :func:`top_group_values` and :func:`top_k_of_candidates` make two (and their wrappers'
    tensors): (values float32 ``[n, width]`` descending, divided by the temperature, those
    below the k-th at -inf; ids int64 ``[n, width]``; complete bool ``[n]``) from x float32
    ``[n, V]``, its group maxima float32 ``[n, G]`` (G > width), k int64 ``[n]`` and
    temperature float32 ``[n, 1]`` or None. The two kernels' bodies in turn, so their bits.
    None where the compiled path does not run or a row holds a NaN."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous() or width >= maxima.shape[1]:
        return None
    import torch
    n = x.shape[0]
    values, ids = torch.empty((n, width)), torch.empty((n, width), dtype=torch.long)
    complete = torch.empty(n, dtype=torch.bool)
    t = _ones(n) if temperature is None else temperature.reshape(-1).contiguous().numpy()
    if not kernels["group_top_k"](x.numpy(), maxima.contiguous().numpy(), group, k.contiguous().numpy(), t,
                                  values.numpy(), ids.numpy(), complete.numpy()):
        return None
    return values, ids, complete


def chain_params(width: int, k: torch.Tensor, temperature: Optional[torch.Tensor],
                 min_p: Optional[torch.Tensor], margin: float, top_p: Optional[torch.Tensor],
                 tolerance: float, typical: Optional[tuple] = None) -> tuple:
    """The rows' parameters of :func:`candidate_chain` as the kernel takes them (made once
    per plan by its caller: a step converts none): ``width`` candidate columns, k int64
    ``[n]``, temperature float32 ``[n, 1]`` (None: 1), min_p float32 ``[n]`` (None: off),
    min-p's margin, top_p float32 ``[n]`` (None: off), top-p's tolerance, ``typical``: None
    (off) or (typical_p float32 ``[n]``, its mass margin, score margin and lowest log p, as
    :func:`typical_of_candidates` takes them)."""
    n = k.shape[0]
    off = _ones(0)
    typical_p, mass_margin, score_margin, lowest = (None, 0.0, 0.0, 0.0) if typical is None else typical
    return (width, k.contiguous().numpy(),
            _ones(n) if temperature is None else temperature.reshape(-1).contiguous().numpy(),
            off if min_p is None else min_p.contiguous().numpy(), float(margin),
            off if top_p is None else top_p.contiguous().numpy(), float(tolerance),
            off if typical_p is None else typical_p.contiguous().numpy(), float(mass_margin),
            float(score_margin), float(lowest))


def candidate_chain(x: torch.Tensor, maxima: torch.Tensor, group: int, params: tuple,
                    out: Optional[tuple] = None, maxima_array=None, scratch=None):
    """Steps 11-13a on the candidates of every row of a few-row block in one compiled call:
    :func:`group_top_k`, then :func:`min_p_of_candidates`, :func:`top_p_of_candidates` and
    :func:`typical_of_candidates` on its values when asked, the same bodies in the same
    order, so their bits. x float32 ``[n, V]``, its group maxima float32 ``[n, G]``,
    ``params`` from :func:`chain_params`.
    Returns (values float32 ``[n, width]``, ids int64 ``[n, width]``) when every row is
    complete and settled by each; None otherwise (or where the compiled path does not run, or
    G <= width): the caller then takes the steps one by one, whose fallbacks serve the rows
    this cannot.

    ``out``: (values, ids, their numpy views), buffers of those shapes the caller lends
    (``Workspace.pair``); ``maxima_array``: maxima's numpy view when the caller has it (each
    conversion or allocation avoided is several operator calls of a B = 1 step);
    ``scratch``: a float64 numpy ``[3, width]`` the kernel works in (made here when None).
    Up to 64 candidate columns the kernel allocates nothing, so a step after the cache flush
    reads no fresh memory (its scratch and outputs are the workspace's, in use every step)."""
    kernels = _compiled()
    width = params[0]
    if kernels is None or not x.is_contiguous() or width >= maxima.shape[1]:
        return None
    import torch
    if out is None:
        n = x.shape[0]
        values, ids = torch.empty((n, width)), torch.empty((n, width), dtype=torch.long)
        out = (values, ids, values.numpy(), ids.numpy())
    if maxima_array is None:
        maxima_array = maxima.contiguous().numpy()
    if scratch is None:
        import numpy
        scratch = numpy.empty((3, width))
    if not _on_logits(kernels, "candidate_chain", x, maxima_array, group, *params[1:], out[2], out[3], scratch):
        return None
    return out[0], out[1]


def _on_logits(kernels: dict, name: str, x: torch.Tensor, *args):
    """``kernels[name]`` on the logits x ``[n, V]`` (contiguous) and ``args``: for float32 x
    its ``_by_address`` form, which reads them at ``x.data_ptr()`` (their numpy view would be
    four operator calls of a B = 1 step), else on the numpy view."""
    import torch
    if x.dtype == torch.float32:
        n, V = x.shape
        return kernels[name + "_by_address"](x.data_ptr(), n, V, *args)
    return kernels[name](x.numpy(), *args)


def seeded_race_winners(values: torch.Tensor, minus_noise: torch.Tensor, ids: torch.Tensor,
                        arrays: Optional[tuple] = None, outputs: Optional[tuple] = None):
    """The winners of seeded candidate races in one compiled call where torch makes four to
    six: (ids int64 ``[n]``, finite bool ``[n]``: whether the winner's value is finite, every:
    whether all are, read in the call) from the candidates' values float32 ``[n, W]``, their
    ids int64 ``[n, W]`` and their ``minus_noise`` float32 ``[n, W]``, ``log(-log(u))`` of
    the contract's uniforms. The scores are the float32 ``values - minus_noise`` torch makes,
    the winner the lowest id among the largest (``draw.race_seeded_candidates``): the same
    subtraction and comparisons, so the same winners. None where the compiled path does not
    run. ``arrays``: the numpy views of (values, minus_noise, ids) when the caller has them
    (contiguous), so none is converted here. The ids and flags are new tensors: ``outputs``
    when the caller lends them (``Workspace.fresh``: (ids, its numpy view), (flags, its
    numpy view)), else made by numpy (``torch.empty`` and its numpy view would be two
    operator calls each)."""
    kernels = _compiled()
    if kernels is None:
        return None
    if arrays is None:
        arrays = (values.contiguous().numpy(), minus_noise.contiguous().numpy(), ids.contiguous().numpy())
    return _winners(kernels["seeded_race_winners"], arrays, values.shape[0], outputs)


def seeded_race_candidates(x: torch.Tensor, keys: torch.Tensor, group: int, cap: int, workspace=None,
                           keys_array=None):
    """The tokens that can win each row's seeded race over whole rows, found with the noise of
    few tokens: (values float32 ``[n, w]``, ids int64 ``[n, w]``) holding every token whose
    score ``x + noise`` may be the row's largest (rows padded with -inf), w <= ``cap``, from
    x float32 ``[n, V]`` (contiguous) and keys int32 ``[n]``. Each token's score is estimated
    in float64 within a bound of torch's float32 one, and the groups of ``group`` tokens are
    bounded by their largest logit and largest uniform, so most groups are passed over
    unopened. None where the compiled path does not run, or where it cannot serve the rows
    (a NaN or +inf logit, a row of -inf only, more than ``cap`` candidates in a row): the
    caller's race over every token answers those. ``workspace`` lends the buffers;
    ``keys_array``: keys' numpy view when the caller has it."""
    import torch
    kernels = _compiled()
    if kernels is None or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    n, V = x.shape
    if workspace is not None:
        (values, values_array), (ids, ids_array) = (workspace.pair("race_candidates", (n, cap)),
                                                    workspace.pair("race_candidate_ids", (n, cap), torch.long))
    else:
        values, ids = torch.empty((n, cap)), torch.empty((n, cap), dtype=torch.long)
        values_array, ids_array = values.numpy(), ids.numpy()
    if keys_array is None:
        keys_array = keys.contiguous().numpy()
    width = kernels["seeded_race_candidates_by_address"](x.data_ptr(), n, V, keys_array, group, values_array,
                                                         ids_array)
    if width == 0:
        return None
    if width == cap:
        return values, ids
    return values[:, :width].contiguous(), ids[:, :width].contiguous()


def seeded_candidates_settled(values: torch.Tensor, ids: torch.Tensor, keys_array,
                              arrays: Optional[tuple] = None, outputs: Optional[tuple] = None):
    """The winners of seeded candidate races settled without torch's noise: (ids int64
    ``[n]``, finite bool ``[n]``, True) when, in every row, the float64 estimate of one
    candidate's score less its slack lies above every other candidate's estimate plus its
    slack (each estimate is within its slack of torch's float32 score, as in
    :func:`seeded_race_candidates`), so that candidate is the reference's winner; None where
    a row is not settled (near ties), holds a NaN or +inf or nothing finite, or the compiled
    path does not run: :func:`seeded_race_winners` then races with torch's noise. values
    float32 ``[n, W]``, ids int64 ``[n, W]``, ``keys_array`` int32 numpy ``[n]``; ``arrays``
    and ``outputs`` as :func:`unseeded_race_winners`'s."""
    kernels = _compiled()
    if kernels is None:
        return None
    if arrays is None:
        arrays = (values.contiguous().numpy(), ids.contiguous().numpy())
    won = _winners(kernels["seeded_candidates_settled"], (arrays[0], arrays[1], keys_array),
                   values.shape[0], outputs)
    return won if won[2] else None


def unseeded_race_winners(values: torch.Tensor, ids: torch.Tensor, key, arrays: Optional[tuple] = None,
                          outputs: Optional[tuple] = None):
    """The winners of unseeded candidate races in one compiled call, noise included: (ids
    int64 ``[n]``, finite bool ``[n]``, every: whether all are finite) from the candidates'
    values float32 ``[n, W]`` and ids int64 ``[n, W]``, each row racing with Gumbel noise
    ``-log(-log(u))`` in float64 whose uniforms are a hash (splitmix64's finaliser) of
    ``key`` (int64 numpy ``[1]``, drawn from the sampler's generator for the step), the row
    and the token id; the first largest score wins, a NaN value first. One draw from the
    generator per step where the torch race's noise (``draw.race_unseeded_candidates``) is
    four operator calls over ``[n, W]``; the winners follow the same distribution, not the
    same uniforms. None where the compiled path does not run. ``arrays``: numpy views of
    (values, ids). The ids and flags are new tensors, ``outputs`` or made, as
    :func:`seeded_race_winners`'s."""
    kernels = _compiled()
    if kernels is None:
        return None
    if arrays is None:
        arrays = (values.contiguous().numpy(), ids.contiguous().numpy())
    return _winners(kernels["unseeded_race_winners"], (arrays[0], arrays[1], key), values.shape[0], outputs)


def _winners(kernel, arrays: tuple, n: int, outputs: Optional[tuple]):
    """(ids, finite, every) of a race kernel called on ``arrays`` and its two outputs, new
    tensors each call (both may go to the caller: the step's ids, and its valid flags when
    every winner is finite): ``outputs``' when lent, else numpy's."""
    if outputs is None:
        import numpy
        import torch
        out, flags = numpy.empty(n, dtype=numpy.int64), numpy.empty(n, dtype=numpy.bool_)
        every = kernel(*arrays, out, flags)
        return torch.from_numpy(out), torch.from_numpy(flags), every
    (ids, out), (finite, flags) = outputs
    return ids, finite, kernel(*arrays, out, flags)


def group_and_row_maxima(x: torch.Tensor, group: int, maxima, top) -> Optional[bool]:
    """The group maxima of x float32 ``[n, V]`` (contiguous, V a multiple of ``group``) into
    ``maxima`` (float32 numpy ``[n, V // group]``), each row's maximum into ``top`` (float32
    numpy ``[n]``) and whether every row's is finite and nonzero, in one compiled pass over
    the logits by address, where torch's ``amax`` and a test of its result are two calls,
    each a code path of its own (a cold B = 1 step pays for each). The maxima are torch's
    values (compared through their bits: exact), a zero one's sign aside. False as soon as a
    group holds a NaN (``maxima`` then partly written); None where the compiled path does
    not run."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous():
        return None
    import torch
    if x.dtype != torch.float32:
        return None
    n, V = x.shape
    return kernels["group_maxima_by_address"](x.data_ptr(), n, V, group, maxima, top)


def first_max_at(x: torch.Tensor, maxima: torch.Tensor, top: torch.Tensor, group: int,
                 arrays: Optional[tuple] = None, out: Optional[tuple] = None):
    """``rowops.first_argmax``'s search in one compiled call where torch makes about eight:
    int64 ``[n]``, the lowest index of each row's maximum ``top`` (float32 ``[n]`` or ``[n,
    1]``, no NaN) in x float32 ``[n, V]`` (contiguous), found through its group maxima
    float32 ``[n, G]`` (groups of ``group`` tokens). Exact comparisons, so torch.argmax's
    answer. None where the compiled path does not run or a row does not hold ``top``.
    ``arrays``: (maxima, top) as numpy arrays (top's ``[n]``) when the caller has them
    (each tensor-to-numpy conversion is an operator call or two); ``out``: a new int64
    ``[n]`` tensor and its numpy view the caller lends (``Workspace.fresh``) for the ids."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous():
        return None
    import numpy
    import torch
    if arrays is None:
        arrays = (maxima.contiguous().numpy(), top.reshape(-1).contiguous().numpy())
    # without a lent tensor, a new array each call (the ids go to the caller), made by numpy:
    # torch.empty and its numpy view would be two operator calls
    ids, found = out if out is not None else (None, numpy.empty(x.shape[0], dtype=numpy.int64))
    if not _on_logits(kernels, "first_max_at", x, arrays[0], arrays[1], group, found):
        return None
    return torch.from_numpy(found) if ids is None else ids


def typical_of_candidates(values: torch.Tensor, typical_p: torch.Tensor, mass_margin: float,
                          score_margin: float, lowest: float, values_array=None, out: Optional[tuple] = None,
                          typical_p_array=None):
    """Step 13a on candidate rows by the compiled kernel: (values with the tokens outside the
    typical set at -inf, settled bool ``[n]``) from the candidates float32 ``[n, W]`` (-inf =
    dropped; every token outside them is dropped too) and typical_p float32 ``[n]`` (1 keeps
    all). The reference's rule (``corelib.filter_stages.typical_keep``) in float64 on the
    candidates; a row is settled where no decision lies within the margins of the
    reference's float32 rounding (see ``select.typical_candidates``). None where the
    compiled path does not run (the caller then reads whole rows).

    ``values_array``: values' numpy view when the caller has it; ``out``: (values, settled,
    their numpy views), buffers of those shapes the caller lends (``Workspace.pair``);
    ``typical_p_array``: typical_p's numpy view when the caller keeps one."""
    kernels = _compiled()
    if kernels is None:
        return None
    if out is None:
        import torch
        n, W = values.shape
        kept, settled = torch.empty((n, W)), torch.empty(n, dtype=torch.bool)
        out = (kept, settled, kept.numpy(), settled.numpy())
    if values_array is None:
        values_array = values.contiguous().numpy()
    if typical_p_array is None:
        typical_p_array = typical_p.contiguous().numpy()
    kernels["candidate_typical"](values_array, typical_p_array, float(mass_margin),
                                 float(score_margin), float(lowest), out[2], out[3])
    return out[0], out[1]


def count_at_least(x: torch.Tensor, value: torch.Tensor):
    """int64 ``[n]``: ``(x >= value).sum(dim=-1)`` (the reference's rank count) for x float32
    ``[n, V]`` and value float32 ``[n, 1]``, in one compiled pass where the torch path makes
    six over ``[n, V]``. Integer counts of the same comparisons, so the same numbers. None
    where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous():
        return None
    import torch
    out = torch.empty(x.shape[0], dtype=torch.long)
    kernels["count_at_least"](x.numpy(), value.reshape(-1).contiguous().numpy(), out.numpy())
    return out


#: Up to this many top-N logprobs, ``top_and_rank`` inserts into a sorted array; past it a
#: row's insertions cost more than the torch path's search.
TOP_AND_RANK_WIDTH = 64


def top_and_rank(x: torch.Tensor, token_ids: torch.Tensor, width: int):
    """Step 15 in one compiled pass per row: (ids int64 ``[n, width + 1]``, values float32
    ``[n, width + 1]``, ranks int64 ``[n]``) for x float32 ``[n, V]`` log-probabilities and
    token_ids int64 ``[n]`` (negative ids read id 0): column 0 the sampled token and its
    value, then the ``width`` largest values, descending, among equal values the lowest id
    first (the contract's order, as ``rowops.top_logprobs``), and the rank ``(x >=
    sampled).sum(-1)``. None where the compiled path does not run, a row holds a NaN (the
    torch path ranks it as +inf), an id is >= V, or ``width`` is above
    ``TOP_AND_RANK_WIDTH`` or not below V (every token: a stable sort)."""
    kernels = _compiled()
    V = x.shape[1]
    if kernels is None or not x.is_contiguous() or not 0 <= width <= TOP_AND_RANK_WIDTH or width >= V:
        return None
    import torch
    n = x.shape[0]
    ids, values = torch.empty((n, width + 1), dtype=torch.long), torch.empty((n, width + 1))
    ranks = torch.empty(n, dtype=torch.long)
    if not kernels["top_and_rank"](x.numpy(), token_ids.numpy(), ids.numpy(), values.numpy(), ranks.numpy()):
        return None
    return ids, values, ranks


def _ones(n: int):
    """float32 numpy ``[n]`` of ones, made once per n (read only)."""
    ones = _state.get(("ones", n))
    if ones is None:
        import numpy as np
        ones = _state[("ones", n)] = np.ones(n, dtype=np.float32)
    return ones


def collect_above(row: torch.Tensor, maxima: torch.Tensor, group: int, threshold: float, cap: int):
    """The tokens of one row that reach ``threshold``, found through its group maxima (only
    groups whose maximum reaches it are read): (values float32 ``[m]``, ids int64 ``[m]``,
    ascending ids) from row float32 ``[V]`` and maxima float32 ``[G]`` (groups of ``group``
    tokens). None where the compiled path does not run, more than ``cap`` tokens reach the
    threshold, or a maximum is NaN."""
    kernels = _compiled()
    if kernels is None or not row.is_contiguous():
        return None
    import numpy as np
    import torch
    values, ids = torch.empty(cap), torch.empty(cap, dtype=torch.long)
    count = kernels["collect_above"](row.numpy(), maxima.contiguous().numpy(), group, np.float32(threshold),
                                     values.numpy(), ids.numpy())
    if count < 0:
        return None
    return values[:count], ids[:count]


def min_p_chain(x: torch.Tensor, row: int, maxima_array, group: int, threshold: float, temperature: float,
                min_p: float, margin: float, out: tuple):
    """Steps 10-11 of row ``row`` of x float32 ``[n, V]`` (contiguous) as candidates, in one
    compiled call where the steps one by one make about sixty operator calls:
    :func:`collect_above`'s tokens (threshold a float32 value; ``maxima_array`` the row's
    group maxima, numpy float32 ``[G]``), sorted descending, divided by ``temperature`` (a
    float32 value) and cut by min-p's rule on them (:func:`min_p_of_candidates`; ``min_p`` a
    float32 value), with the same bits as those steps. ``out``: (values, ids, their numpy
    views), float32 and int64 ``[1, cap]`` buffers the caller lends. Returns (values float32
    ``[1, m]``, ids int64 ``[1, m]``, their numpy views), views of ``out``, when the row is
    settled; False where more than cap tokens reach the threshold or a maximum is NaN (as
    :func:`collect_above`'s None: the row takes the whole-row cut); None where the compiled
    path does not run or a candidate lies within min-p's margin (the caller then takes the
    steps one by one)."""
    import numpy as np
    import torch
    kernels = _compiled()
    if kernels is None or not x.is_contiguous() or x.dtype != torch.float32:
        return None
    n, V = x.shape
    count, settled = kernels["min_p_chain"](x.data_ptr(), n, V, row, maxima_array, group, np.float32(threshold),
                                            np.float32(temperature), np.float32(min_p), float(margin),
                                            out[2], out[3])
    if count < 0:
        return False
    if not settled:
        return None
    return out[0][:, :count], out[1][:, :count], out[2][:, :count], out[3][:, :count]


def min_p_of_candidates(values: torch.Tensor, min_p: torch.Tensor, margin: float):
    """``select.min_p_of_candidates`` by the compiled kernel, one call where torch makes
    about twelve: (values with min-p's dropped tokens at -inf, settled bool ``[n]``) from the
    descending candidates float32 ``[n, W]`` and min_p float32 ``[n]``. The same float64
    distances; where numpy's log and torch's may differ in the last bit of a float64, the
    distance is inside ``margin``, so that row is unsettled on both paths. None where the
    compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n, W = values.shape
    out, settled = torch.empty((n, W)), torch.empty(n, dtype=torch.bool)
    kernels["candidate_min_p"](values.contiguous().numpy(), min_p.contiguous().numpy(), float(margin),
                               out.numpy(), settled.numpy())
    return out, settled


def top_k_of_candidates(values: torch.Tensor, k: torch.Tensor, temperature: Optional[torch.Tensor],
                        floor: torch.Tensor, whole: bool):
    """The tail of ``select.top_k_candidates`` by the compiled kernel: (values float32 ``[n,
    W]`` divided by the temperature with those below the k-th at -inf, complete bool ``[n]``)
    from the descending candidates ``values`` float32 ``[n, W]``, k int64 ``[n]``,
    temperature float32 ``[n, 1]`` or None, floor float32 ``[n]`` and ``whole`` (every
    token a candidate). The same float32 divisions and comparisons, so the same bits. None
    where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n, W = values.shape
    t = torch.ones(n) if temperature is None else temperature.reshape(-1).contiguous()
    out, complete = torch.empty((n, W)), torch.empty(n, dtype=torch.bool)
    kernels["candidate_top_k"](values.contiguous().numpy(), k.contiguous().numpy(), t.numpy(),
                               floor.contiguous().numpy(), whole, out.numpy(), complete.numpy())
    return out, complete


def top_p_of_candidates(values: torch.Tensor, top_p: torch.Tensor, tolerance: float):
    """``select.top_p_candidates_fast`` by the compiled kernel: (values with the tokens
    outside the nucleus at -inf, settled bool ``[n]``) from the descending candidates
    ``values`` float32 ``[n, W]`` and top_p float32 ``[n]``. The candidates' softmax, its
    prefix sums and the settling margins are computed in float64: closer to the exact values
    than torch's float32 softmax, so ``tolerance`` (relative, what the torch path allows for
    two float32 softmaxes) still proves a settled row's nucleus to be the reference's. Rows
    holding a NaN, or no finite value, are never settled (top_p >= 1 always is). None where
    the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n, W = values.shape
    out, settled = torch.empty((n, W)), torch.empty(n, dtype=torch.bool)
    kernels["candidate_top_p"](values.contiguous().numpy(), top_p.contiguous().numpy(),
                               float(tolerance), out.numpy(), settled.numpy())
    return out, settled


def smooth_rows(x: torch.Tensor, top: torch.Tensor, square: torch.Tensor, cube: torch.Tensor) -> bool:
    """Quadratic smoothing in place by the compiled kernel: each finite logit v of x float32
    ``[n, V]`` (contiguous rows) becomes ``(m - a d d) + b d d d``, d = v - m, with the row's m,
    a and b from top, square, cube float32 ``[n, 1]``: the reference's float32 products in
    its order, so its bits. Returns False, writing nothing, where the compiled path does not
    run."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous():
        return False
    kernels["smooth"](x.numpy(), top.reshape(-1).contiguous().numpy(), square.reshape(-1).contiguous().numpy(),
                      cube.reshape(-1).contiguous().numpy())
    return True


def adaptive_rows(x: torch.Tensor, p: torch.Tensor, aim: torch.Tensor) -> bool:
    """Adaptive-p's transform in place by the compiled kernel: each logit of x float32
    ``[n, V]`` (contiguous rows) above -inf becomes ``5 - 10 u u / (1 + u)``, u = ``|p - a| /
    0.3`` with p float32 ``[n, V]`` (contiguous) and the row's a of aim float32 ``[n]``: the
    reference's float32 operations in its order (``selectors.adaptive_logits``), so its bits.
    Returns False, writing nothing, where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous() or not p.is_contiguous():
        return False
    import numpy as np
    from corelib.selectors import ADAPTIVE_WIDTH
    kernels["adaptive"](x.numpy(), p.numpy(), aim.contiguous().numpy(), np.float32(ADAPTIVE_WIDTH))
    return True


def tfs_thresholds(q: torch.Tensor, n: torch.Tensor, tfs: torch.Tensor) -> Optional[torch.Tensor]:
    """``filter_stages.tfs_thresholds`` by two compiled passes around torch's sum: the
    second differences (the reference's float64 operations in its order, 0 past n - 2), their
    total by torch (the same reduction, so the same bits), then the running sum of the
    normalised weights in token order (torch's cumsum is sequential too) up to the first that
    passes tfs. float32 [m, 1] thresholds from q float64 [m, V] (descending), n int64 [m, 1],
    tfs float32 [m]; None where the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    m, V = q.shape
    q = q.contiguous()
    counts = n.reshape(-1).contiguous()
    second = torch.empty((m, max(V - 2, 0)), dtype=torch.float64)
    kernels["tfs_second"](q.numpy(), counts.numpy(), second.numpy())
    total = second.sum(dim=-1)
    j = torch.empty(m, dtype=torch.long)
    kernels["tfs_index"](second.numpy(), total.numpy(), counts.numpy(), tfs.double().contiguous().numpy(),
                         j.numpy())
    return q.gather(1, (j - 1)[:, None]).to(torch.float32)


def pack_above(x: torch.Tensor, floor: float, out: torch.Tensor) -> bool:
    """The kept-set words of ``x > floor`` by the compiled kernel: out int32 ``[n, ceil(V /
    32)]`` (contiguous) gets bit ``j % 32`` of word ``j // 32`` set where ``x[r, j] > floor``
    (NaN: not set), bits for ids >= V 0 (``corelib.bitmask.pack_kept``'s layout); x float32
    ``[n, V]`` contiguous rows. One read of x, where torch's comparison, conversion and
    weighted sum make four passes over ``[n, V]``. Returns False, writing nothing, where the
    compiled path does not run (or the machine is big-endian: the kernel writes the words'
    bytes)."""
    kernels = _compiled()
    if kernels is None or not x.is_contiguous() or not out.is_contiguous() or sys.byteorder != "little":
        return False
    import numpy as np
    import torch
    kernels["pack_above"](x.numpy(), np.float32(floor), out.view(torch.uint8).numpy())
    return True


def bucket_mass(probs: torch.Tensor, shift: int, buckets: int):
    """Pass 1 of ``select.select_by_histogram`` in one read: (float64 ``[n, buckets]`` the
    probabilities' mass per bucket ``clamp(bits >> shift, 0, buckets - 1)`` of their float32
    bits, int64 ``[n, buckets]`` the tokens per bucket) from probs float32 ``[n, V]``. The
    float64 sums run in token order, as ``torch.bincount``'s do, so the same bits. None where
    the compiled path does not run."""
    kernels = _compiled()
    if kernels is None:
        return None
    import torch
    n = probs.shape[0]
    probs = probs.contiguous()
    mass = torch.zeros((n, buckets), dtype=torch.float64)
    count = torch.zeros((n, buckets), dtype=torch.long)
    kernels["bucket_mass"](probs.numpy(), probs.view(torch.int32).numpy(), shift, buckets - 1,
                           mass.numpy(), count.numpy())
    return mass, count


def band_indices(probs: torch.Tensor, bucket: torch.Tensor, shift: int, buckets: int,
                 size: int) -> torch.Tensor:
    """int64 ``[size]``: the flat indices (row * V + token, ascending) of the tokens of probs
    float32 ``[n, V]`` in their row's ``bucket`` (int64 ``[n]``), ``size`` of them (the
    caller counted them with :func:`bucket_mass`). The compiled path only."""
    import torch
    out = torch.empty(size, dtype=torch.long)
    found = _compiled()["band_indices"](probs.contiguous().view(torch.int32).numpy(),
                                        bucket.contiguous().numpy(), shift, buckets - 1, out.numpy())
    assert found == size
    return out


def reset() -> None:
    """Forget the kernel choice, so the next call reads ``CORELIB_CPU_KERNELS`` again."""
    _state.clear()
