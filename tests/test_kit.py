"""The plugin-author kit: the conformance suite's failures name the contract rule, the row and
its parameters; plugins/_template renamed builds as a wheel whose installed copy passes its own
tests and the one-line ``--corelib-backend`` run of the kit."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corelib import Sampler, SamplingBatch
from corelib.noise import row_keys, seeded_gumbel
from corelib.testing import ConformanceSuite

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "plugins" / "_template"
suite = ConformanceSuite()
REF = Sampler("cpu")


# ---------------------------------------------------------------------- broken backends
class IgnoresLogitBias(Sampler):
    def apply_logit_bias(self, x, s):
        return x


class GreedyPicksHighestIdOnTies(Sampler):
    def argmax(self, x):
        return x.shape[-1] - 1 - torch.argmax(x.flip(-1), dim=-1)


class NoiseIgnoresPosition(Sampler):
    def draw(self, x, s):
        keys = row_keys(s.seed_lo, s.seed_hi, s.child, torch.zeros_like(s.position))[:, None]
        vocab = torch.arange(x.shape[1], dtype=torch.int32)[None, :]
        return torch.argmax(x + seeded_gumbel(keys, vocab), dim=-1)


class NoiseKeyedByRowPlace(Sampler):
    """Uses the row's place in the batch where the contract says child index."""
    def draw(self, x, s):
        place = torch.arange(s.num_rows, dtype=torch.int32)
        return super().draw(x, type(s)(**{**s.__dict__, "child": place}))


class IgnoresBadWords(Sampler):
    def apply_bad_words(self, x, s):
        return x


class StaleRowsBatch(SamplingBatch):
    """Forgets to move the tail rows' device state into the holes a removal leaves."""
    def _move_rows(self, src, dst):
        pass


class StaleRowsOnRemove(Sampler):
    batch_class = StaleRowsBatch


class RankOffByOne(Sampler):
    def gather_logprobs(self, logprobs, token_ids, num_logprobs):
        out = super().gather_logprobs(logprobs, token_ids, num_logprobs)
        out.ranks = out.ranks + 1
        return out


class FlaggedRowsReturnZero(Sampler):
    def sample(self, logits, batch):
        out = super().sample(logits, batch)
        out.token_ids = out.token_ids.clamp(min=0)
        return out


class SkewedDraw(Sampler):
    def draw(self, x, s):
        return super().draw(x * 1.1, s)


def fails_with(*fragments: str):
    """pytest.raises for a suite failure whose message holds every fragment, in order."""
    return pytest.raises(pytest.fail.Exception, match=".*".join(re.escape(f) for f in fragments))


# ---------------------------------------------------------------------- failure messages
def test_kept_set_failure_names_step_row_and_params():
    with fails_with("contract step 6 (logit_bias)", "kept logits differ",
                    "row 0 (request 'r0', child 0, position 1",
                    "params SamplingParams(logit_bias={0: 5.0, 17: -100.0, 42: 2.5})", "token"):
        suite.test_kept_set_matches_reference(IgnoresLogitBias("cpu"), REF, "logit_bias")


def test_greedy_failure_names_the_tied_row():
    with fails_with("contract step 9 (temperature 0 = argmax, lowest id on ties)",
                    "row 2 (request 'g2', child 0, position 0, params SamplingParams(temperature=0.0))",
                    "got token 20, expected 10"):
        suite.test_greedy_is_argmax_lowest_id_on_ties(GreedyPicksHighestIdOnTies("cpu"))


def test_seeded_failure_names_request_child_params_and_position():
    with fails_with("contract seeded draws (equal to the reference's", "request 's-plain' child 0",
                    "params SamplingParams(seed=11)", "first at position 1"):
        suite.test_seeded_tokens_equal_the_reference(NoiseIgnoresPosition("cpu"), REF)


def test_batch_composition_failure_names_the_row_place():
    with fails_with("contract seeded draws (independent of batch size", "request 's-",
                    "params SamplingParams(", "at row", "of a mixed batch of 18 rows"):
        suite.test_seeded_tokens_independent_of_batch_composition(NoiseKeyedByRowPlace("cpu"))


def test_masked_draw_failure_names_row_and_params():
    with fails_with("contract steps 3-4 (allowed_token_ids, bad_words", "token 6 drawn at row 0",
                    "request 'm0'", "allowed_token_ids=[5, 6, 7, 8]", "bad_words=[[6]]"):
        suite.test_masked_tokens_never_drawn(IgnoresBadWords("cpu"))


def test_removal_failure_names_the_moved_row():
    # s-order (the last row) moves into s-topk's place and must keep its own state.
    with fails_with("contract continuous batching", "request 's-order' child 0",
                    "params SamplingParams(temperature=0.6, top_k=30, min_p=0.05, seed=20", "now at row 1"):
        suite.test_remove_keeps_other_rows_state(StaleRowsOnRemove("cpu"))


def test_logprobs_failure_names_mode_and_row():
    with fails_with("contract step 15 (logprobs", "rank of the sampled token differs",
                    "row 0 (request 'g'", "logprobs=5", "mode 'raw'", "reference 1"):
        suite.test_logprobs_match_reference(RankOffByOne("cpu"), REF, "raw")


def test_bad_row_failure_names_the_cause():
    with fails_with("contract bad rows", "row 1 (request 'nan'", "with a NaN logit",
                    "returned token", "expected -1"):
        suite.test_bad_rows_are_flagged_and_do_not_touch_others(FlaggedRowsReturnZero("cpu"), REF)


def test_chi_square_failure_names_params_and_counts():
    with fails_with("contract step 14 (draw", "chi-square p=", "1000 identical rows x 20 calls",
                    "params SamplingParams(temperature=0.9, top_k=60, top_p=0.95, min_p=0.001)",
                    "expected"):
        suite.test_draws_follow_the_reference_distribution(SkewedDraw("cpu"), REF, True)


def test_every_suite_failure_goes_through_a_named_rule():
    """No bare assert is left in the suite: each check fails via violation(rule, message)."""
    source = (ROOT / "corelib" / "testing" / "conformance.py").read_text()
    body = source[source.index("class ConformanceSuite"):]
    assert not re.search(r"^\s+assert\b", body, re.M), "a bare assert would fail without naming its rule"
    assert "pytest.fail(" not in body and "assert_close" not in body
    from corelib.testing.conformance import RULES
    used = set(re.findall(r'violation\(\s*"(\w+)"', body)) | set(re.findall(r'rule = "(\w+)"', body))
    from corelib.testing.conformance import STAGE_RULES
    used |= set(STAGE_RULES.values())
    assert used <= set(RULES), f"unknown rules {used - set(RULES)}"


# ---------------------------------------------------------------------- the template
def rename_template(destination: Path, name: str) -> Path:
    """README.md's rename procedure: copy, rename the package, replace the name in every file."""
    shutil.copytree(TEMPLATE, destination, ignore=shutil.ignore_patterns(
        "build", "dist", "*.egg-info", "__pycache__"))
    (destination / "corelib_template").rename(destination / f"corelib_{name}")
    for path in destination.rglob("*"):
        if path.is_file() and path.name != "README.md":
            text = path.read_text()
            path.write_text(text.replace("Template", name.capitalize()).replace("template", name))
    return destination


def isolation_flags() -> list[str]:
    """Build with this environment's setuptools when it can make wheels by itself (>= 70.1,
    or older with the `wheel` package); otherwise let pip fetch a build environment."""
    import importlib.metadata as md
    import importlib.util
    try:
        version = tuple(int(p) for p in md.version("setuptools").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return []
    if version >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return ["--no-build-isolation"]
    return []


def run(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_renamed_template_builds_installs_and_passes_its_tests(tmp_path):
    name = "kitcheck"
    source = rename_template(tmp_path / name, name)
    leftovers = [str(p) for p in source.rglob("*") if "template" in p.name.lower()]
    leftovers += [str(p) for p in source.rglob("*.py") if "template" in p.read_text().lower()]
    assert not leftovers, f"the rename missed {leftovers}"

    py = sys.executable
    run([py, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation_flags(),
         "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)
    wheels = list((tmp_path / "dist").glob(f"corelib_{name}-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    site = tmp_path / "site"
    run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheels[0])],
        cwd=tmp_path)

    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run([py, "-c", f"import corelib_{name} as m; print(m.__file__)"], cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(str(site)), "tests must import the installed wheel"
    # The plugin's own tests: discovery, its stage, and the whole conformance kit.
    tests = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(source),
                 str(source / "tests")], cwd=tmp_path, env=env)
    assert passed_count(tests.stdout) >= 80 and "failed" not in tests.stdout, tests.stdout[-2000:]
    # The kit's one-line form, on the freshly installed backend.
    kit = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
               "corelib.testing.suite", "--corelib-backend", name, "-k", "kept_set or greedy"],
              cwd=tmp_path, env=env)
    assert passed_count(kit.stdout) >= 20 and "skipped" not in kit.stdout, kit.stdout[-2000:]
    assert "failed" not in kit.stdout, kit.stdout[-2000:]


def passed_count(output: str) -> int:
    """The ``N passed`` of a pytest summary line (0 when absent)."""
    found = re.search(r"\b(\d+) passed\b", output)
    return int(found.group(1)) if found else 0


# ---------------------------------------------------------------------- the docs
DOCS = ROOT / "docs"


def plain_signature(obj) -> str | None:
    """``(a, b=1, *, c=None)``: parameter names and defaults, no annotations (or None)."""
    import inspect
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parts, starred = [], False
    for p in signature.parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            starred = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not starred:
                parts.append("*")
                starred = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


def public_api() -> list[str]:
    """The lines docs/api.md must contain: ``name(signature)`` for every public callable,
    ``Class.method(signature)`` or ``Class.property`` for the classes users call into."""
    import corelib
    import corelib.bitmask as bitmask
    import corelib.integrations.hf as hf
    import corelib.testing as testing
    lines = []
    for module in (corelib, bitmask, testing, hf):
        for name in module.__all__:
            obj = getattr(module, name)
            signature = plain_signature(obj) if callable(obj) else None
            if isinstance(obj, type) and issubclass(obj, BaseException):
                signature = None
            lines.append(name.replace("_", r"\_") if name.startswith("__") else name + (signature or ""))
    for cls in (corelib.Sampler, corelib.SamplingBatch, testing.ConformanceSuite, hf.GenerateOutput):
        # the Sampler's stages, verification and scoring parts live in modules of their own
        # (classes it mixes in), but are its methods
        members = {}
        for part in reversed(cls.__mro__ if cls is corelib.Sampler else (cls,)):
            if part.__module__.startswith("corelib"):
                members.update(vars(part))
        for name, member in members.items():
            if name.startswith("_") or name.startswith("test_"):
                continue
            if isinstance(member, property):
                lines.append(f"{cls.__name__}.{name}")
            elif callable(member) or isinstance(member, (staticmethod, classmethod)):
                lines.append(f"{cls.__name__}.{name}{plain_signature(getattr(cls, name))}")
    return lines


def test_api_reference_lists_every_public_name_with_its_signature():
    text = (DOCS / "api.md").read_text()
    missing = [line for line in public_api() if line not in text]
    assert not missing, "docs/api.md lacks these lines (add them with a description):\n" + "\n".join(missing)


def test_contract_examples_are_the_reference_backends_output():
    import doctest
    result = doctest.testfile(str(DOCS / "contract.md"), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 20 and result.failed == 0, result


def test_plugin_guide_quotes_the_kit_failure_it_shows():
    class TopKOffByOne(Sampler):
        def apply_top_k(self, x, s):
            k = (s.top_k + 1) * (s.top_k > 0)
            return super().apply_top_k(x, type(s)(**{**s.__dict__, "top_k": k}))
    with pytest.raises(pytest.fail.Exception) as failure:
        suite.test_kept_set_matches_reference(TopKOffByOne("cpu"), REF, "top_k")
    guide = " ".join((DOCS / "plugins.md").read_text().split())
    assert " ".join(str(failure.value).split()) in guide


REPO = DOCS.resolve().parent
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
READMES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in REPO.glob("plugins/*/README.md"))


@pytest.mark.parametrize("page", [f"docs/{name}" for name in PAGES] + READMES)
def test_links_stay_inside_the_repository_and_resolve(page):
    path = REPO / page
    text = path.read_text()
    broken, outside = [], []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            outside.append(target)
            continue
        resolved = (path.parent / target).resolve()
        if REPO != resolved and REPO not in resolved.parents:
            outside.append(target)
        elif not resolved.exists():
            broken.append(target)
    assert not outside, f"{page} links outside the repository: {outside}"
    assert not broken, f"{page} links to missing files: {broken}"
