"""The corelib command line."""

import json
import subprocess
import sys

import pytest

from corelib import cli
from corelib.registry import Registry, reset_default_registry


@pytest.fixture(autouse=True)
def core_only_registry(monkeypatch):
    monkeypatch.delenv("CORELIB_DEVICE", raising=False)
    reset_default_registry(Registry(load_entry_points=False))
    yield
    reset_default_registry(None)


def test_info_lists_backends_and_the_selection(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "<- selected" in out
    assert "corelib.get_sampler() -> 'reference'" in out


def test_info_json_is_machine_readable(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selected"] == "reference"
    assert data["backends"][0]["name"] == "reference" and data["backends"][0]["selected"]


def test_bench_prints_a_table_and_writes_csv(tmp_path, capsys):
    csv_path = tmp_path / "bench.csv"
    code = cli.main(["bench", "--batch-sizes", "1,2", "--vocab-sizes", "1000", "--configs",
                     "random,full", "--repeats", "1", "--csv", str(csv_path)])
    assert code == 0
    captured = capsys.readouterr()
    assert "speedup" in captured.out and "passes" in captured.out
    assert "4/4" in captured.err                     # the progress bar reached the end
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 5 and lines[0].startswith("backend,config,batch_size")


def test_bench_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert cli.main(["bench", "--batch-sizes", "1,2", "--vocab-sizes", "500", "--configs", "random",
                     "--repeats", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_configs(capsys):
    assert cli.main(["bench", "--configs", "warp"]) == 2
    assert "unknown config(s) ['warp']" in capsys.readouterr().err


def test_unknown_backend_is_a_clean_error(capsys):
    assert cli.main(["bench", "--backend", "nope"]) == 1
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_bench_help_explains_the_options():
    result = subprocess.run([sys.executable, "-m", "corelib", "bench", "--help"],
                            capture_output=True, text=True, check=True)
    assert "--batch-sizes" in result.stdout and "passes" in result.stdout


def test_demo_runs(capsys):
    assert cli.main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "creative child 1" in out and "short benchmark" in out
