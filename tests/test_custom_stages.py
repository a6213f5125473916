"""Custom stages from plugins: descriptions, discovery through real entry points, per-request
arguments checked at add, per-row state through append/remove/swap/resume, failures isolated."""

from importlib.metadata import entry_points

import pytest
import torch
from pydantic import BaseModel

import corelib
from corelib import Sampler, SamplingParams, StageError, StageSpec, StageState
from corelib.registry import Registry, reset_default_registry

V = 30
REF = Sampler("cpu")


class Level(BaseModel):
    level: float = 1.0


class Times(BaseModel):
    times: int = 2


def subtract_level(x, inputs):
    return x - inputs.args["level"][:, None]


def count_outputs(prompt, output, args, vocab_size):
    return torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab_size).to(torch.int32)


def count_token(state, token_ids, live):
    return state.scatter_add(1, token_ids[:, None], live[:, None].to(state.dtype))


def ban_seen(x, inputs):
    return x.masked_fill(inputs.state["seen"] >= inputs.args["times"][:, None], float("-inf"))


SEEN = StageState("seen", torch.int32, lambda vocab: (vocab,), count_outputs, count_token)


class StagePlugin:
    def __init__(self, *specs, error=None):
        self.specs, self.error = list(specs), error

    @corelib.hookimpl
    def corelib_stages(self):
        if self.error:
            raise self.error
        return self.specs


@pytest.fixture
def registry():
    registry = Registry(load_entry_points=False)
    reset_default_registry(registry)
    yield registry
    reset_default_registry(None)


def add(batch, rid, prompt=(), output=None, **params):
    return batch.add(rid, SamplingParams(**params), prompt_token_ids=list(prompt), output_token_ids=output)


def test_a_stage_runs_at_its_slot_on_the_rows_that_use_it(registry):
    registry.register(StagePlugin(StageSpec("shift", "after_penalties", Level, subtract_level)), "p")
    batch = REF.new_batch(V)
    add(batch, "on", stage_args={"shift": {"level": 2.5}}, temperature=0.5)
    add(batch, "off", temperature=0.5)
    logits = torch.randn((2, V), generator=torch.Generator().manual_seed(0))
    got = REF.processed_logits(logits, batch)
    assert torch.allclose(got[0], (logits[0] - 2.5) / 0.5)      # after 8a, before temperature
    assert torch.allclose(got[1], logits[1] / 0.5)


def test_after_filters_stages_see_the_filtered_logits_and_skip_greedy_rows(registry):
    seen = {}

    def record(x, inputs):
        seen["kept"] = torch.isfinite(x).sum(dim=-1).tolist()
        return x

    registry.register(StagePlugin(StageSpec("spy", "after_filters", Level, record)), "p")
    batch = REF.new_batch(V)
    add(batch, "k", top_k=3, stage_args={"spy": {}})
    add(batch, "g", temperature=0.0, stage_args={"spy": {}})
    out = REF.processed_logits(torch.randn((2, V)), batch)
    assert seen["kept"][0] == 3                       # top-k ran before the stage
    assert torch.isfinite(out[1]).all()               # greedy rows end at step 8a


def test_unknown_stages_and_bad_arguments_are_rejected_at_add(registry):
    registry.register(StagePlugin(StageSpec("ban", "after_penalties", Times, ban_seen, state=(SEEN,))), "p")
    batch = REF.new_batch(V)
    with pytest.raises(ValueError, match="unknown stage 'bann' .*known stages: ban"):
        add(batch, "a", stage_args={"bann": {}})
    with pytest.raises(ValueError, match=r"(?s)stage_args\['ban'\] is invalid.*times"):
        add(batch, "a", stage_args={"ban": {"times": "many"}})
    with pytest.raises(ValueError, match=r"stage_args\['ban'\] has unknown arguments \['often'\]"):
        add(batch, "a", stage_args={"ban": {"often": 3}})
    assert batch.rows == []


def test_stage_state_starts_from_the_outputs_and_follows_appends_moves_and_swaps(registry):
    registry.register(StagePlugin(StageSpec("ban", "after_penalties", Times, ban_seen, state=(SEEN,))), "p")
    batch = REF.new_batch(V)
    add(batch, "x", temperature=0.0)
    add(batch, "a", output=[4, 4, 1], temperature=0.0, stage_args={"ban": {"times": 2}})
    add(batch, "b", temperature=0.0, stage_args={"ban": {"times": 1}})
    logits = torch.zeros((3, V))
    logits[:, 4] = 3.0
    logits[:, 1] = 2.0
    assert REF.sample(logits, batch).token_ids.tolist() == [4, 1, 4]    # a: 4 seen twice
    batch.append([4, 1, 4])
    assert REF.sample(logits, batch).token_ids.tolist() == [4, 0, 1]    # a: 1 twice now; b: 4 once
    batch.remove("x")                                  # b moves into row 0
    batch.swap_rows(0, 1)
    assert batch.rows == [("a", 0), ("b", 0)]
    assert REF.sample(logits[:2], batch).token_ids.tolist() == [0, 1]
    resumed = REF.new_batch(V)
    add(resumed, "a", output=[4, 4, 1, 1], temperature=0.0, stage_args={"ban": {"times": 2}})
    assert REF.sample(logits[:1], resumed).token_ids.tolist() == [0]


def test_a_failing_stage_raises_stage_error_naming_it_and_changes_nothing(registry):
    def broken(x, inputs):
        raise RuntimeError("out of registers")

    def broken_update(state, token_ids, live):
        raise RuntimeError("cannot count")

    registry.register(StagePlugin(StageSpec("boom", "after_filters", Level, broken),
                                  StageSpec("wrong-shape", "after_filters", Level, lambda x, i: x[:, :3]),
                                  StageSpec("bad-state", "after_penalties", Times, ban_seen,
                                            state=(StageState("seen", torch.int32, lambda v: (v,),
                                                              count_outputs, broken_update),))), "faulty")
    batch = REF.new_batch(V)
    add(batch, "ok", seed=1)
    add(batch, "boom", stage_args={"boom": {}})
    with pytest.raises(StageError, match="stage 'boom' \\(plugin 'faulty'\\) failed: RuntimeError: out of registers"):
        REF.sample(torch.zeros((2, V)), batch)
    batch.remove("boom")
    add(batch, "shape", stage_args={"wrong-shape": {}})
    with pytest.raises(StageError, match="stage 'wrong-shape'.*returned torch.float32 \\[2, 3\\]"):
        REF.sample(torch.zeros((2, V)), batch)
    batch.remove("shape")
    add(batch, "state", stage_args={"bad-state": {}})
    before = {k: v.clone() for k, v in vars(batch.step_state()).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(StageError, match="stage 'bad-state'.*state 'seen' update failed"):
        batch.append([1, 2])
    after = {k: v for k, v in vars(batch.step_state()).items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert batch.generated_counts() == [0, 0]


def test_a_backend_may_register_a_faster_implementation(registry):
    calls = []

    def fast(x, inputs):
        calls.append("fast")
        return subtract_level(x, inputs)

    spec = StageSpec("shift", "after_penalties", Level, subtract_level, implementations={"reference": fast})
    registry.register(StagePlugin(spec), "p")
    batch = REF.new_batch(V)
    add(batch, "on", stage_args={"shift": {"level": 1.0}})
    REF.sample(torch.zeros((1, V)), batch)
    assert calls == ["fast"]


@pytest.mark.parametrize("spec,fragment", [
    (StageSpec("x", "after_step_3", Level, subtract_level), "slot must be one of"),
    (StageSpec("", "after_filters", Level, subtract_level), "stage name must be a non-empty str"),
    (StageSpec("x", "after_filters", dict, subtract_level), "args must be a pydantic model class"),
    ("not a spec", "expected corelib.StageSpec"),
])
def test_malformed_descriptions_are_reported_and_isolated(registry, spec, fragment):
    registry.register(StagePlugin(spec), "bad")
    registry.register(StagePlugin(StageSpec("fine", "after_filters", Level, subtract_level)), "good")
    statuses = {s.plugin: s for s in registry.stage_statuses()}
    assert not statuses["bad"].available and fragment in statuses["bad"].reason
    assert registry.stages().keys() == {"fine"}


def test_two_plugins_claiming_one_stage_name_disable_it(registry):
    registry.register(StagePlugin(StageSpec("dup", "after_filters", Level, subtract_level)), "one")
    registry.register(StagePlugin(StageSpec("dup", "after_filters", Level, subtract_level)), "two")
    assert registry.stages() == {}
    assert all("claimed by several plugins" in s.reason for s in registry.stage_statuses())


# ---------------------------------------------------------------------- an engine's own stages
def test_use_stage_runs_on_every_row_as_stage_args_would(registry):
    """An engine's stage (no registry entry, no stage_args) acts on every row, its state from
    each row's output and following appends, moves and swaps, exactly as the same stage named
    by every request through a plugin."""
    spec = StageSpec("ban", "after_penalties", Times, ban_seen, state=(SEEN,))
    registry.register(StagePlugin(StageSpec("ban-plugin", "after_penalties", Times, ban_seen,
                                            state=(SEEN,))), "p")
    logits = torch.randn((3, V), generator=torch.Generator().manual_seed(3)) * 3
    engine, plugin = REF.new_batch(V), REF.new_batch(V)
    engine.use_stage(spec, "engine-x")
    for batch, args in ((engine, {}), (plugin, {"stage_args": {"ban-plugin": {}}})):
        add(batch, "a", output=[5, 5], temperature=0.0, **args)
        add(batch, "b", temperature=0.0, **args)
        add(batch, "c", seed=4, **args)
    tokens = {"engine": [], "plugin": []}
    for step in range(6):
        if step == 3:
            for batch in (engine, plugin):
                batch.remove("a")
                batch.swap_rows(0, 1)
        for name, batch in (("engine", engine), ("plugin", plugin)):
            out = REF.sample(logits[: batch.num_rows], batch)
            batch.append(out.token_ids)
            tokens[name].append(out.token_ids.tolist())
    assert tokens["engine"] == tokens["plugin"]
    history = [5, 5] + [step[0] for step in tokens["engine"][:3]]      # greedy "a"
    assert max(history.count(t) for t in history) == 2               # no token a third time
    assert int(logits[0].argmax()) in history[2:]                    # the stage had to act


def test_use_stage_refuses_a_batch_with_rows_a_taken_name_and_bad_specs(registry):
    registry.register(StagePlugin(StageSpec("shift", "after_penalties", Level, subtract_level)), "p")
    batch = REF.new_batch(V)
    with pytest.raises(ValueError, match="'shift'\\): a stage of that name is already in use"):
        batch.use_stage(StageSpec("shift", "after_filters", Level, subtract_level))
    batch.use_stage(StageSpec("own", "after_filters", Level, subtract_level))
    with pytest.raises(ValueError, match="'own'\\): a stage of that name is already in use"):
        batch.use_stage(StageSpec("own", "after_filters", Level, subtract_level))
    with pytest.raises(TypeError, match="plugin 'mine' returned 'nope', expected corelib.StageSpec"):
        batch.use_stage("nope", "mine")
    with pytest.raises(ValueError, match="slot must be one of"):
        batch.use_stage(StageSpec("x", "early", Level, subtract_level))
    add(batch, "a")
    with pytest.raises(ValueError, match="use_stage\\('late'\\): the batch already has rows"):
        batch.use_stage(StageSpec("late", "after_filters", Level, subtract_level))


def test_a_failing_engine_stage_names_itself(registry):
    def broken(x, inputs):
        raise RuntimeError("no luck")

    batch = REF.new_batch(V)
    batch.use_stage(StageSpec("boom", "after_penalties", Level, broken), "my-engine")
    add(batch, "a")
    with pytest.raises(StageError, match="stage 'boom' \\(plugin 'my-engine'\\) failed: RuntimeError: no luck"):
        REF.sample(torch.zeros((1, V)), batch)


# ---------------------------------------------------------------------- real entry points
installed = {ep.name for ep in entry_points(group="corelib.plugins")}
needs_plugins = pytest.mark.skipif(
    not {"stage-example", "bad-stage-description", "raising-stage"} <= installed,
    reason="test plugins not installed (scripts/test.sh installs tests/plugins/*)")


@needs_plugins
def test_installed_stage_plugins_are_discovered_and_broken_ones_reported(monkeypatch):
    monkeypatch.delenv("CORELIB_PLUGINS", raising=False)
    statuses = {s.name: s for s in Registry().stage_statuses()}
    assert statuses["ban-repeats"].available and statuses["ban-repeats"].distribution == "corelib-stage-example"
    assert statuses["floor-prob"].slot == "after_filters"
    assert "slot must be one of" in statuses["bad-stage-description"].reason
    assert "libbrokenaccel.so" in statuses["broken"].reason
    assert statuses["explodes"].available          # well described; fails only when it runs


@needs_plugins
def test_corelib_info_lists_the_stages(monkeypatch, capsys):
    from corelib.cli import main
    monkeypatch.delenv("CORELIB_PLUGINS", raising=False)
    reset_default_registry(None)
    try:
        assert main(["info"]) == 0
    finally:
        reset_default_registry(None)
    out = capsys.readouterr().out
    assert "ban-repeats" in out and "after_penalties" in out and "corelib-stage-example" in out
    assert "bad-stage-description" in out and "slot must be one of" in out


@needs_plugins
def test_the_example_stage_bans_repeats_with_the_installed_plugin(monkeypatch):
    monkeypatch.delenv("CORELIB_PLUGINS", raising=False)
    reset_default_registry(None)
    try:
        batch = REF.new_batch(V)
        add(batch, "r", temperature=0.0, stage_args={"ban-repeats": {"times": 1}})
        logits = torch.arange(V, dtype=torch.float32)[None]
        tokens = []
        for _ in range(4):
            out = REF.step(logits, batch)
            tokens += out.token_ids.tolist()
        assert tokens == [29, 28, 27, 26]
    finally:
        reset_default_registry(None)


def test_an_add_that_fails_in_a_stage_leaves_the_rows_that_joined_before_it(registry):
    wrong_init = StageState("seen", torch.int32, lambda v: (v,),
                            lambda prompt, output, args, vocab: torch.zeros(3, dtype=torch.int32),
                            count_token)
    registry.register(StagePlugin(StageSpec("bad-init", "after_penalties", Times, ban_seen,
                                            state=(wrong_init,))), "faulty")
    batch = REF.new_batch(V)
    add(batch, "a", temperature=0.5, seed=3)
    add(batch, "b", n=2, top_k=4)           # joined since the state was last read
    for n in (1, 40):                       # 40 rows: the batch grows, then shrinks back
        with pytest.raises(StageError, match="state 'seen' init returned shape"):
            add(batch, "bad", n=n, stage_args={"bad-init": {}}, temperature=0.25, min_tokens=7)
    s = batch.step_state(5)
    assert s.temperature.tolist() == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert s.top_k.tolist() == [0, 4, 4, 0, 0] and s.child.tolist() == [0, 0, 1, 0, 0]
    assert s.min_tokens.tolist() == [0] * 5 and s.seeded.tolist() == [True] + [False] * 4
    add(batch, "c", top_p=0.5)
    assert batch.step_state().top_p.tolist() == [1.0, 1.0, 1.0, 0.5]
