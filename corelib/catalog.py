"""Which custom stages a batch may run: the catalog a sampler hands its batches.

A sampler from ``corelib.get_sampler`` hands its batches the stages of the registry that
made it (``Registry.get_sampler``); a sampler or batch built directly asks the process-wide
registry through ``installed_stages``, which the registry provides when it is loaded. This
module imports nothing of corelib, so the batch depends on it and not on the registry (which
imports the sampler, which imports the batch).
"""

from __future__ import annotations

from typing import Callable, Optional

#: name -> (StageSpec, plugin name), as ``Registry.stages`` returns them.
StageCatalog = Callable[[], dict]

_provider: Optional[StageCatalog] = None


def provide(catalog: StageCatalog) -> None:
    """Make ``catalog`` the process-wide one (the registry calls this when it is loaded)."""
    global _provider
    _provider = catalog


def installed_stages() -> dict:
    """The process-wide registry's custom stages (none before a registry is loaded)."""
    return _provider() if _provider is not None else {}
