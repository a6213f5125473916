"""Plugin discovery, backend descriptions and platform detection behind ``get_sampler``."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, fields
from importlib.metadata import entry_points
from typing import Any, Optional

import pluggy
import torch

from . import catalog, hookspecs
from .backends import Availability, BackendSpec  # noqa: F401  (importable from here too)
from .sampler import Sampler
from .stages import StageSpec, check_stage_spec

ENV_DEVICE = "CORELIB_DEVICE"
ENV_PLUGINS = "CORELIB_PLUGINS"


def _shown_fields(status: Any) -> dict[str, Any]:
    """A status dataclass as JSON-ready data: the fields its repr shows (not the error
    object or the spec), in declaration order."""
    return {f.name: getattr(status, f.name) for f in fields(status) if f.repr}


@dataclass
class BackendStatus:
    """One line of ``available_backends()``."""

    name: str
    plugin: str
    distribution: Optional[str]
    version: Optional[str]
    device_type: Optional[str]
    priority: Optional[int]
    available: bool
    reason: str = ""
    auto: bool = False
    description: str = ""
    #: whose ``score`` runs when the logits require grad: "own" or "reference" (None: unknown)
    score_gradients: Optional[str] = None
    error: Optional[BaseException] = field(default=None, repr=False)
    spec: Optional[BackendSpec] = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return _shown_fields(self)


@dataclass
class StageStatus:
    """One line of ``available_stages()``: a custom stage (or a plugin whose stages could not
    be read), the plugin and distribution providing it, and whether requests may use it."""

    name: str
    plugin: str
    distribution: Optional[str]
    version: Optional[str]
    slot: Optional[str]
    available: bool
    reason: str = ""
    description: str = ""
    error: Optional[BaseException] = field(default=None, repr=False)
    spec: Optional[StageSpec] = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return _shown_fields(self)


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here; ``reason`` says why."""


@dataclass
class _PluginRecord:
    name: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    error: Optional[BaseException] = None


class Registry:
    """Loads plugins once (lazily), asks each for its backends, and chooses among them."""

    def __init__(self, load_entry_points: bool = True, allow: Optional[set[str]] = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._load_entry_points = load_entry_points
        self._allow = allow
        self._plugins: dict[str, _PluginRecord] = {}
        self._statuses: Optional[list[BackendStatus]] = None
        self._stage_statuses: Optional[list[StageStatus]] = None
        self._lock = threading.Lock()
        from . import builtin
        self.register(builtin, name="reference", distribution="corelib")

    # ------------------------------------------------------------------ loading
    def register(self, plugin: object, name: str, distribution: Optional[str] = None,
                 version: Optional[str] = None) -> None:
        """Register a plugin object (module or instance with hook implementations)."""
        if version is None and distribution == "corelib":
            from . import __version__ as version
        self.pm.register(plugin, name=name)
        self._plugins[name] = _PluginRecord(name, distribution, version)
        self._statuses = None
        self._stage_statuses = None

    def unregister(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin, name=name)
        self._plugins.pop(name, None)
        self._statuses = None
        self._stage_statuses = None

    def _load_plugins(self) -> None:
        if not self._load_entry_points:
            return
        self._load_entry_points = False
        allow = self._allow if self._allow is not None else _allow_list_from_env()
        for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            if ep.name in self._plugins:
                continue
            dist = getattr(ep, "dist", None)
            dist_name = dist.name if dist is not None else None
            dist_version = dist.version if dist is not None else None
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the core down
                self._plugins[ep.name] = _PluginRecord(ep.name, dist_name, dist_version, exc)
                continue
            try:
                self.register(plugin, name=ep.name, distribution=dist_name, version=dist_version)
            except Exception as exc:
                self._plugins[ep.name] = _PluginRecord(ep.name, dist_name, dist_version, exc)

    # ------------------------------------------------------------------ describing
    def statuses(self, refresh: bool = False) -> list[BackendStatus]:
        """Every discovered backend (and every broken plugin), probed once and cached."""
        with self._lock:
            if self._statuses is None or refresh:
                self._load_plugins()
                self._statuses = self._describe()
            return list(self._statuses)

    def _describe(self) -> list[BackendStatus]:
        statuses: list[BackendStatus] = []
        for record in self._plugins.values():
            if record.error is not None:
                statuses.append(self._broken(record, record.name,
                                             f"plugin failed to import: {_describe_error(record.error)}",
                                             record.error))
        for impl in self.pm.hook.corelib_backends.get_hookimpls():
            record = self._plugins.get(impl.plugin_name, _PluginRecord(impl.plugin_name))
            try:
                specs = impl.function()
                specs = _check_specs(specs, impl.plugin_name)
            except Exception as exc:
                statuses.append(self._broken(record, record.name,
                                             f"plugin hook corelib_backends failed: {_describe_error(exc)}",
                                             exc))
                continue
            for spec in specs:
                statuses.append(self._probe(record, spec))
        return _mark_conflicts(statuses, "backend")

    def stage_statuses(self, refresh: bool = False) -> list[StageStatus]:
        """Every custom stage the plugins describe (and every plugin whose stages could not be
        read: a failed import, a failing hook, a malformed description), cached."""
        with self._lock:
            if self._stage_statuses is None or refresh:
                self._load_plugins()
                self._stage_statuses = self._describe_stages()
            return list(self._stage_statuses)

    def stages(self) -> dict[str, tuple[StageSpec, str]]:
        """The usable custom stages: name -> (spec, plugin name), in discovery order."""
        return {s.name: (s.spec, s.plugin) for s in self.stage_statuses() if s.available}

    def _describe_stages(self) -> list[StageStatus]:
        statuses: list[StageStatus] = []
        for record in self._plugins.values():
            if record.error is not None:
                statuses.append(_broken_stage(record, f"plugin failed to import: {_describe_error(record.error)}",
                                              record.error))
        for impl in self.pm.hook.corelib_stages.get_hookimpls():
            record = self._plugins.get(impl.plugin_name, _PluginRecord(impl.plugin_name))
            try:
                specs = impl.function()
                specs = [specs] if isinstance(specs, StageSpec) else list(specs or [])
                specs = [check_stage_spec(spec, impl.plugin_name) for spec in specs]
            except Exception as exc:
                statuses.append(_broken_stage(record, f"plugin hook corelib_stages failed: "
                                                      f"{_describe_error(exc)}", exc))
                continue
            for spec in specs:
                statuses.append(StageStatus(spec.name, record.name, record.distribution, record.version,
                                            spec.slot, True, description=spec.description, spec=spec))
        return _mark_conflicts(statuses, "stage")

    @staticmethod
    def _broken(record: _PluginRecord, name: str, reason: str, exc: BaseException) -> BackendStatus:
        return BackendStatus(name=name, plugin=record.name, distribution=record.distribution,
                             version=record.version, device_type=None, priority=None,
                             available=False, reason=reason, error=exc)

    @staticmethod
    def _probe(record: _PluginRecord, spec: BackendSpec) -> BackendStatus:
        status = BackendStatus(name=spec.name, plugin=record.name, distribution=record.distribution,
                               version=record.version, device_type=spec.device_type,
                               priority=spec.priority, available=False,
                               description=spec.description, spec=spec,
                               score_gradients="own" if spec.differentiable_score else "reference")
        try:
            availability = spec.probe()
            if not isinstance(availability, Availability):
                raise TypeError(f"probe must return corelib.Availability, got {type(availability).__name__}")
        except Exception as exc:
            status.reason = f"probe failed: {_describe_error(exc)}"
            status.error = exc
            return status
        status.available = availability.available
        status.reason = availability.reason
        status.auto = availability.available and availability.auto
        return status

    # ------------------------------------------------------------------ choosing
    def choose(self, device: str | torch.device | None = None) -> tuple[BackendStatus, Optional[torch.device]]:
        """The backend (and torch device) that ``get_sampler(device)`` would use."""
        statuses = self.statuses()
        if device is None:
            device = os.environ.get(ENV_DEVICE) or None
        if device is None:
            return _auto_select(statuses), None
        if isinstance(device, torch.device):
            return _by_device_type(statuses, device), device
        if not isinstance(device, str):
            raise TypeError(f"device must be None, a backend name or a torch.device, got {device!r}")
        name, _, index = device.partition(":")
        for status in statuses:
            if status.name == name:
                status = _require(status)
                return status, (_indexed_device(status, index) if index else None)
        try:
            torch_device = torch.device(device)
        except RuntimeError:
            torch_device = None
        if torch_device is not None and any(s.device_type == torch_device.type for s in statuses):
            return _by_device_type(statuses, torch_device), torch_device
        raise ValueError(
            f"unknown backend {device!r}; known backends: {_names(statuses)} "
            f"(available: {_names([s for s in statuses if s.available])})"
        )

    def get_sampler(self, device: str | torch.device | None = None) -> Sampler:
        status, torch_device = self.choose(device)
        try:
            sampler = status.spec.factory(torch_device)
        except Exception as exc:
            raise BackendUnavailableError(
                f"backend {status.name!r} (plugin {status.plugin!r}) failed to start: "
                f"{_describe_error(exc)}"
            ) from exc
        if not isinstance(sampler, Sampler):
            raise BackendUnavailableError(
                f"backend {status.name!r} factory returned {type(sampler).__name__}, not a corelib.Sampler"
            )
        sampler.stage_catalog = self.stages      # its batches run this registry's stages
        return sampler


def _broken_stage(record: _PluginRecord, reason: str, exc: BaseException) -> StageStatus:
    return StageStatus(name=record.name, plugin=record.name, distribution=record.distribution,
                       version=record.version, slot=None, available=False, reason=reason, error=exc)


def _check_specs(specs, plugin_name: str) -> list[BackendSpec]:
    if isinstance(specs, BackendSpec):
        specs = [specs]
    if specs is None:
        return []
    if not isinstance(specs, (list, tuple)):
        raise TypeError(f"plugin {plugin_name!r} returned {type(specs).__name__}, expected a list of BackendSpec")
    for spec in specs:
        if not isinstance(spec, BackendSpec):
            raise TypeError(f"plugin {plugin_name!r} returned {spec!r}, expected corelib.BackendSpec")
        if not isinstance(spec.name, str) or not spec.name or ":" in spec.name:
            raise ValueError(f"plugin {plugin_name!r}: backend name must be a non-empty str without ':', got {spec.name!r}")
        if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
            raise TypeError(f"plugin {plugin_name!r}: backend {spec.name!r} priority must be an int, got {spec.priority!r}")
        if not callable(spec.probe) or not callable(spec.factory):
            raise TypeError(f"plugin {plugin_name!r}: backend {spec.name!r} probe and factory must be callable")
    return list(specs)


def _mark_conflicts(statuses: list, kind: str) -> list:
    """Make every status whose name several plugins claim unavailable (backend or stage
    statuses; ``kind`` names them in the reason)."""
    by_name: dict[str, list] = {}
    for status in statuses:
        if status.spec is not None:
            by_name.setdefault(status.name, []).append(status)
    for name, claims in by_name.items():
        if len(claims) > 1:
            plugins = ", ".join(repr(c.plugin) for c in claims)
            for claim in claims:
                claim.available = False
                if isinstance(claim, BackendStatus):
                    claim.auto = False
                claim.reason = f"{kind} name {name!r} is claimed by several plugins: {plugins}"
                claim.error = None
    return statuses


def _auto_select(statuses: list[BackendStatus]) -> BackendStatus:
    candidates = [s for s in statuses if s.auto]
    if not candidates:
        raise BackendUnavailableError(
            "no backend is available; discovered: "
            + "; ".join(f"{s.name}: {s.reason or 'unavailable'}" for s in statuses)
        )
    return max(candidates, key=lambda s: (s.priority, s.name))


def _by_device_type(statuses: list[BackendStatus], device: torch.device) -> BackendStatus:
    claims = [s for s in statuses if s.device_type == device.type]
    ready = [s for s in claims if s.available]
    if ready:
        return max(ready, key=lambda s: (s.priority, s.name))
    if claims:
        return _require(max(claims, key=lambda s: (s.priority or 0, s.name)))
    raise ValueError(f"no backend runs on device type {device.type!r}; known backends: {_names(statuses)}")


def _require(status: BackendStatus) -> BackendStatus:
    if status.available and status.spec is not None:
        return status
    message = f"backend {status.name!r} (plugin {status.plugin!r}) is not available: {status.reason}"
    if status.error is not None:
        raise BackendUnavailableError(message) from status.error
    raise BackendUnavailableError(message)


def _indexed_device(status: BackendStatus, index: str) -> torch.device:
    if not index.isdigit():
        raise ValueError(f"device index after {status.name!r}: must be a non-negative int, got {index!r}")
    return torch.device(status.device_type, int(index))


def _names(statuses: list[BackendStatus]) -> str:
    return ", ".join(sorted({s.name for s in statuses})) or "none"


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _allow_list_from_env() -> Optional[set[str]]:
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


_default: Optional[Registry] = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry()
        return _default


# Samplers and batches built directly ask the process-wide registry for custom stages.
catalog.provide(lambda: default_registry().stages())


def reset_default_registry(registry: Optional[Registry] = None) -> None:
    """Replace (or drop, so it reloads) the process-wide registry; for tests and tools."""
    global _default
    with _default_lock:
        _default = registry


def get_sampler(device: str | torch.device | None = None) -> Sampler:
    """A sampler for ``device``: None = platform detection (``CORELIB_DEVICE`` overrides),
    a backend name ("cpu", "cuda", "tpu", "reference", a third-party name, "cuda:1"), or a
    ``torch.device`` (the best available backend of that device type)."""
    return default_registry().get_sampler(device)


def available_backends() -> list[BackendStatus]:
    """Every discovered backend, available or not (with the reason), and every broken plugin."""
    return default_registry().statuses()


def available_stages() -> list[StageStatus]:
    """Every custom stage the plugins describe, usable or not (with the reason), and every
    plugin whose stages could not be read."""
    return default_registry().stage_statuses()
