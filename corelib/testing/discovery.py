"""The discovery check every plugin's suite starts with."""

from __future__ import annotations

from importlib.metadata import entry_points

from ..hookspecs import ENTRY_POINT_GROUP


def assert_entry_point(name: str, module: object, distribution: str) -> None:
    """The entry point ``name`` in group ``corelib.plugins`` exists once, belongs to
    ``distribution`` and loads exactly ``module`` (the plugin's hook module)."""
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    assert len(eps) == 1, f"expected one {name!r} entry point in {ENTRY_POINT_GROUP}, found {eps}"
    assert eps[0].load() is module, f"entry point {name!r} loads {eps[0].value}, not {module!r}"
    assert eps[0].dist.name == distribution, (
        f"entry point {name!r} belongs to {eps[0].dist.name!r}, expected {distribution!r}")
