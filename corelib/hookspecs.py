"""The pluggy hooks a corelib plugin implements (cold path only: discovery and description).

A plugin is a distribution with an entry point in the group ``corelib.plugins`` whose target
(a module or object) holds ``@corelib.hookimpl`` functions named below. Per-step work never
goes through pluggy: the chosen backend's sampler methods are called directly.
"""

from __future__ import annotations

import pluggy

PROJECT = "corelib"
ENTRY_POINT_GROUP = "corelib.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def corelib_backends():
    """Describe the backends this plugin provides.

    Called once per plugin when the registry first loads plugins. Must be cheap and must not
    import the plugin's heavy runtime (torch-xla, flashinfer, ...): probing and creating the
    sampler happen later, through the returned descriptions.

    :return: a list of :class:`corelib.BackendSpec` (or a single one).
    """


@hookspec
def corelib_stages():
    """Describe the custom stages this plugin provides (optional: a plugin may provide backends,
    stages or both).

    Called once per plugin when the registry first lists stages (the first ``batch.add`` that
    names a stage in ``SamplingParams.stage_args``, or ``corelib info``). Must be cheap: return
    descriptions only.

    :return: a list of :class:`corelib.StageSpec` (or a single one).
    """
