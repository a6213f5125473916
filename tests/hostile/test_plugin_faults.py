"""Plugin faults: a plugin that fails to import, raises in its probe or hook, describes itself
badly, fails to start, or raises (or returns nonsense) inside ``sample()``.

What "reported" means (docs/reliability.md):
- discovery faults: ``available_backends()`` lists the plugin, unavailable, with the error in
  ``reason``; auto-detection skips it; asking for it by name raises BackendUnavailableError
  chained to the original error;
- a fault inside ``sample()`` propagates to the caller unchanged (the hot path adds no
  wrapper); ``sample`` never writes to the batch and ``step`` appends only after a successful
  sample, so the batch is left exactly as it was and any other backend can carry on with it;
- a backend built on the core's template that draws an out-of-range id, or a token its own
  filters dropped, gets that row flagged (``valid`` False, id -1) instead of returned.
Other backends keep working in every case. Fake plugins are real modules and entry points
(a ``*.dist-info`` folder put on sys.path), registered in a private Registry per test.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import corelib
from corelib import Availability, BackendSpec, BackendUnavailableError, Sampler, SamplingParams
from corelib.registry import Registry
from hostile_support import Request, assert_same_snapshot, build_batch, snapshot

V = 32


class GoodSampler(Sampler):
    name = "hs-good"


class KernelFault(RuntimeError):
    pass


class RaisingSampler(Sampler):
    """Raises inside sample(), in its draw stage, as a crashing device kernel would."""

    name = "hs-raising"

    def draw(self, x, s):
        raise KernelFault("hs-raising: illegal memory access in the draw kernel")


class OutOfRangeSampler(Sampler):
    """Draws the id V (one past the vocabulary) for every row."""

    name = "hs-out-of-range"

    def draw(self, x, s):
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)


class DroppedTokenSampler(Sampler):
    """Draws the least likely token, which its own filters (top_k) dropped."""

    name = "hs-dropped"

    def draw(self, x, s):
        return torch.argmin(torch.where(torch.isinf(x), torch.full_like(x, -1e30), x), dim=-1)


class WrongShapeSampler(Sampler):
    name = "hs-wrong-shape"

    def draw(self, x, s):
        return torch.zeros(x.shape[0] + 1, dtype=torch.long, device=x.device)


def spec(name, factory=None, probe=None, priority=5):
    return BackendSpec(name=name, device_type="cpu", priority=priority,
                       probe=probe or (lambda: Availability(True)),
                       factory=factory or (lambda device, cls=GoodSampler: cls(device)))


class Plugin:
    def __init__(self, *specs, error=None, returned=None):
        self.specs, self.error, self.returned = list(specs), error, returned

    @corelib.hookimpl
    def corelib_backends(self):
        if self.error is not None:
            raise self.error
        return self.returned if self.returned is not None else self.specs


BROKEN_MODULES = {
    "hs_missing_dep": "import hs_no_such_runtime_module\n",
    "hs_import_raises": "raise RuntimeError('hs: accelerator driver 0.0 is too old')\n",
    "hs_syntax_error": "def broken(:\n",
    "hs_ok_module": textwrap.dedent("""
        import corelib

        @corelib.hookimpl
        def corelib_backends():
            return []
    """),
}
ENTRY_POINTS = {
    "hs-missing-dep": "hs_missing_dep",
    "hs-import-raises": "hs_import_raises",
    "hs-syntax-error": "hs_syntax_error",
    "hs-missing-attr": "hs_ok_module:no_such_object",
}


@pytest.fixture
def broken_distribution(tmp_path, monkeypatch):
    """A real installed-looking distribution whose entry points fail to load, each its own way."""
    for module, source in BROKEN_MODULES.items():
        (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / "hs_broken_plugins-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hs-broken-plugins\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(
        "[corelib.plugins]\n" + "".join(f"{name} = {target}\n" for name, target in ENTRY_POINTS.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for module in BROKEN_MODULES:
        sys.modules.pop(module, None)


def seeded_requests():
    return [Request("a", SamplingParams(seed=1, top_k=5)), Request("b", SamplingParams(seed=2, n=2)),
            Request("c", SamplingParams(temperature=0.0, frequency_penalty=0.5), prompt=[3])]


def logits(rows, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def reference_tokens(requests, x):
    ref = Sampler("cpu")
    return ref.sample(x, build_batch(ref, requests, V)).token_ids


def assert_backend_works(registry, name):
    """The backend samples the seeded requests exactly as the reference does."""
    sampler = registry.get_sampler(name)
    batch = build_batch(sampler, seeded_requests(), V)
    x = logits(len(batch))
    assert torch.equal(sampler.sample(x, batch).token_ids, reference_tokens(seeded_requests(), x))


def test_plugins_that_fail_to_import_are_listed_and_skipped(broken_distribution):
    registry = Registry(allow=set(ENTRY_POINTS))
    registry.register(Plugin(spec("hs-good")), name="hs-good-plugin")
    statuses = {s.name: s for s in registry.statuses()}
    expected = {
        "hs-missing-dep": "ModuleNotFoundError: No module named 'hs_no_such_runtime_module'",
        "hs-import-raises": "RuntimeError: hs: accelerator driver 0.0 is too old",
        "hs-syntax-error": "SyntaxError",
        "hs-missing-attr": "AttributeError",
    }
    for name, fragment in expected.items():
        status = statuses[name]
        assert not status.available and not status.auto, name
        assert status.reason.startswith("plugin failed to import: ") and fragment in status.reason, status.reason
        assert status.distribution == "hs-broken-plugins" and status.version == "0.0.1"
        with pytest.raises(BackendUnavailableError, match="is not available: plugin failed to import") as err:
            registry.get_sampler(name)
        assert err.value.__cause__ is status.error
    assert registry.get_sampler().name == "hs-good"          # auto-detection skips them all
    assert_backend_works(registry, "hs-good")
    assert_backend_works(registry, "reference")


@pytest.mark.parametrize("fault", ["probe_raises", "probe_wrong_type", "hook_raises",
                                   "hook_returns_junk", "spec_bad_name", "factory_raises",
                                   "factory_returns_junk", "name_clash"])
def test_discovery_and_startup_faults_leave_other_backends_working(fault):
    registry = Registry(load_entry_points=False)
    registry.register(Plugin(spec("hs-good", priority=5)), name="hs-good-plugin")

    def raising_probe():
        raise OSError("/dev/hs0: permission denied")

    def raising_factory(device):
        raise ImportError("libhs.so: cannot open shared object file")

    bad, fragment, by_name_error = "hs-bad", None, BackendUnavailableError
    if fault == "probe_raises":
        plugin, fragment = Plugin(spec(bad, probe=raising_probe, priority=50)), "probe failed: OSError: /dev/hs0"
    elif fault == "probe_wrong_type":
        plugin, fragment = Plugin(spec(bad, probe=lambda: "yes", priority=50)), "probe must return corelib.Availability"
    elif fault == "hook_raises":
        plugin = Plugin(error=ZeroDivisionError("hs: division by zero in hook"))
        bad, fragment = "hs-bad-plugin", "hook corelib_backends failed: ZeroDivisionError"
    elif fault == "hook_returns_junk":
        plugin = Plugin(returned=[spec("x"), {"name": "hs"}])
        bad, fragment = "hs-bad-plugin", "expected corelib.BackendSpec"
    elif fault == "spec_bad_name":
        plugin = Plugin(spec("has:colon"))
        bad, fragment = "hs-bad-plugin", "backend name must be a non-empty str without ':'"
    elif fault == "factory_raises":
        plugin, fragment = Plugin(spec(bad, factory=raising_factory, priority=50)), None
    elif fault == "factory_returns_junk":
        plugin, fragment = Plugin(spec(bad, factory=lambda device: object(), priority=50)), None
    else:
        plugin, bad = Plugin(spec("hs-good", priority=50)), "hs-good"
        fragment = "claimed by several plugins"
    registry.register(plugin, name="hs-bad-plugin")
    statuses = [s for s in registry.statuses(refresh=True) if s.name == bad]
    if fragment is not None:
        assert statuses and all(not s.available for s in statuses)
        assert any(fragment in s.reason for s in statuses), [s.reason for s in statuses]
    with pytest.raises(by_name_error):
        registry.get_sampler(bad)
    if fault in ("factory_raises", "factory_returns_junk"):
        # Available by its probe, so auto-detection picks it and reports the failed start.
        with pytest.raises(BackendUnavailableError, match="failed to start|not a corelib.Sampler"):
            registry.get_sampler()
    elif fault != "name_clash":
        assert registry.get_sampler().name == "hs-good"
        assert_backend_works(registry, "hs-good")
    assert_backend_works(registry, "reference")


def test_a_sampler_raising_inside_sample_leaves_the_batch_for_others():
    registry = Registry(load_entry_points=False)
    registry.register(Plugin(spec("hs-raising", factory=lambda d: RaisingSampler(d), priority=50),
                             spec("hs-good")), name="hs-faulty-vendor")
    faulty = registry.get_sampler("hs-raising")
    batch = build_batch(faulty, seeded_requests(), V)
    batch.append([1, 2, 3, 4])
    before, counts = snapshot(batch), batch.generated_counts()
    x = logits(len(batch), seed=7)
    with pytest.raises(KernelFault, match="illegal memory access in the draw kernel"):
        faulty.sample(x, batch)
    with pytest.raises(KernelFault):
        faulty.step(x, batch)
    assert_same_snapshot(before, snapshot(batch), "a failed sample changed the batch")
    assert batch.generated_counts() == counts
    # Another backend carries on with the very same batch, as if nothing had happened.
    fresh = seeded_requests()
    for r in fresh:
        r.outputs = [[t] for t in ({"a": [1], "b": [2, 3], "c": [4]}[r.request_id])]
    good = registry.get_sampler("hs-good")
    assert torch.equal(good.step(x, batch).token_ids, reference_tokens(fresh, x))
    assert batch.generated_counts() == [c + 1 for c in counts]
    # The fault is the plugin's own: the registry still serves it and every other backend.
    assert registry.get_sampler("hs-raising").name == "hs-raising"
    assert registry.get_sampler("reference").name == "reference"


@pytest.mark.parametrize("cls", [OutOfRangeSampler, DroppedTokenSampler])
def test_a_template_backend_drawing_nonsense_gets_its_rows_flagged(cls):
    sampler = cls("cpu")
    requests = [Request("a", SamplingParams(seed=1, top_k=3)), Request("b", SamplingParams(top_k=2, n=2))]
    batch = build_batch(sampler, requests, V)
    x = logits(len(batch), seed=3)
    out = sampler.sample(x, batch)
    assert out.valid.tolist() == [False] * 3 and out.token_ids.tolist() == [-1] * 3
    with pytest.raises(ValueError, match=r"row 0 \(request 'a', child 0\) has no token"):
        out.raise_on_invalid(batch)
    before = snapshot(batch)
    sampler.step(x, batch)           # every row flagged: append records no token for any of them
    assert_same_snapshot(before, snapshot(batch), "step with flagged rows")


def test_a_sampler_returning_the_wrong_shape_raises_and_changes_nothing():
    sampler = WrongShapeSampler("cpu")
    batch = build_batch(sampler, seeded_requests(), V)
    before = snapshot(batch)
    with pytest.raises(RuntimeError):
        sampler.step(logits(len(batch)), batch)
    assert_same_snapshot(before, snapshot(batch), "wrong-shape draw")
    assert batch.generated_counts() == [0] * len(batch)
