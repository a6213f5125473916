"""Optional compiled kernels (numba), each giving exactly the bits of the torch code it
replaces, with that torch code as the automatic fallback.

Two kernels:

- the contract's seeded uniforms (``corelib.noise``), the integer hash of every (row key,
  token) pair, over whole rows or over each row's own token ids;
- the unseeded draw of a small vocabulary (``draw._draw_one_level``): one uniform per row
  through the float64 cumulative sum of the row's weights, in one call where torch makes
  twelve (at V = 512 the step is operator calls, not arithmetic).

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
from typing import TYPE_CHECKING, Optional

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
    """Whether the compiled path is asked for and installable (no import of numba)."""
    return _torch_only() is None


def describe() -> str:
    """Which path the kernels' steps take in this environment, for ``corelib info``."""
    reason = _torch_only()
    if reason is not None:
        return f"kernels: pure torch ({reason})"
    return "kernels: numba (seeded noise, small-vocabulary draw)"


def _compiled():
    """The compiled kernels (the uniforms of whole rows and of per-row ids, and the draw), or
    None (numba missing, refused, or failing to load)."""
    if "kernels" not in _state:
        _state["kernels"] = _compile() if wanted() else None
    return _state["kernels"]


def _compile():
    try:
        import numba
        import numpy as np
    except Exception:                    # a broken install falls back like a missing one
        return None
    from corelib import noise

    # corelib.noise's constants as unsigned 32-bit values, every one uint64: numba types
    # uint64 mixed with int64 as float64
    mask = np.uint64(0xFFFFFFFF)
    mul_1, mul_2, step = (np.uint64(c & 0xFFFFFFFF)
                          for c in (noise._MIX_MUL_1, noise._MIX_MUL_2, noise._TOKEN_STEP))
    s15, s16, top = np.uint64(15), np.uint64(16), np.uint64(32 - noise._UNIFORM_BITS)
    scale = np.float32(noise._UNIFORM_SCALE)
    half = np.float32(noise._UNIFORM_SCALE / 2)

    @numba.njit(inline="always")
    def uniform(key, token):              # pragma: no cover - runs compiled
        h = (key + np.uint64(token) * step) & mask
        h ^= h >> s16
        h = (h * mul_1) & mask
        h ^= h >> s15
        h = (h * mul_2) & mask
        h ^= h >> s16
        return np.float32(h >> top) * scale + half

    @numba.njit(cache=True, nogil=True)
    def whole_rows(keys, out):            # pragma: no cover - runs compiled
        for r in range(out.shape[0]):
            key = np.uint64(keys[r]) & mask
            for j in range(out.shape[1]):
                out[r, j] = uniform(key, j)

    @numba.njit(cache=True, nogil=True)
    def per_row_ids(keys, ids, out):      # pragma: no cover - runs compiled
        for r in range(out.shape[0]):
            key = np.uint64(keys[r]) & mask
            for j in range(out.shape[1]):
                out[r, j] = uniform(key, ids[r, j])

    @numba.njit(cache=True, nogil=True)
    def inverse_cdf(weights, u, ids, ok):  # pragma: no cover - runs compiled
        n, V = weights.shape
        for r in range(n):
            total = 0.0
            for j in range(V):             # torch's float64 cumsum: sequential, same order
                total += np.float64(weights[r, j])
            ok[r] = total > 0.0 and total < np.inf
            target = min(u[r] * total, np.nextafter(total, 0.0))
            running, pick = 0.0, V - 1
            for j in range(V):             # searchsorted(right=True): the first sum > target
                running += np.float64(weights[r, j])
                if running > target:
                    pick = j
                    break
            ids[r] = pick
    return dict(whole_rows=whole_rows, per_row_ids=per_row_ids, inverse_cdf=inverse_cdf)


def seeded_uniforms_into(out: torch.Tensor, keys: torch.Tensor,
                         token_ids: Optional[torch.Tensor] = None) -> bool:
    """``corelib.noise.uniform_noise(keys[:, None], token_ids)`` written into ``out`` by the
    compiled kernel: out float32 ``[n, W]`` contiguous, keys int32 ``[n]``, token_ids None
    (column j is token j: whole rows) or int64 ``[n, W]`` ids in ``[0, 2**31)`` (each row its
    own), all CPU tensors. The token's share of the hash is made in the kernel, so no
    ``token_offsets`` pass is needed. Returns False, writing nothing, when the compiled path
    does not run here (the caller then takes the torch path)."""
    kernels = _compiled()
    if kernels is None or not out.is_contiguous():
        return False
    if token_ids is None:
        kernels["whole_rows"](keys.contiguous().numpy(), out.numpy())
    else:
        kernels["per_row_ids"](keys.contiguous().numpy(), token_ids.contiguous().numpy(), out.numpy())
    return True


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


def reset() -> None:
    """Forget the kernel choice, so the next call reads ``CORELIB_CPU_KERNELS`` again."""
    _state.clear()
