"""The GPU check's summary (``plugins/cuda/gpu_report.py``) from the files its sections leave:
JUnit XML counts and failures, a section cut at its limit, a section without its XML, the
multi-device test's outcome and the benchmark rows printed so far."""

from __future__ import annotations

import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location(
    "gpu_report", pathlib.Path(__file__).resolve().parents[1] / "gpu_report.py")
gpu_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_report)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="plugins.cuda.tests.test_gpu" name="test_steps_never_sync[torch]" time="0.1"/>
<testcase classname="plugins.cuda.tests.test_gpu" name="test_graph_replays_never_sync" time="0.1">
<failure message="HostSyncError: a step synchronised&#10;more">trace</failure></testcase>
<testcase classname="plugins.cuda.tests.test_gpu" name="{multi}" time="0.0">
<skipped type="pytest.skip" message="needs two GPUs (a sampler on cuda:1 while cuda:0 is current)"/></testcase>
</testsuite></testsuites>""".replace("{multi}", gpu_report.MULTI_DEVICE_TEST)


def test_the_summary_reads_what_the_sections_left(tmp_path):
    (tmp_path / "env.txt").write_text("torch 2.11.0, CUDA 13.0, GPUs 1 x NVIDIA H200\n")
    (tmp_path / "sections.txt").write_text(
        "setup: 20 s (limit 60 s, rc 0; 460 s of 480 left)\n"
        "tests-gpu: 90 s (limit 90 s, rc 124: cut at its limit; 300 s of 480 left)\n")
    (tmp_path / "junit-gpu.xml").write_text(JUNIT)
    (tmp_path / "tests-gpu.log").write_text("graph stats: {'captures': 3}\n")
    (tmp_path / "tests-conformance.log").write_text("....\n")        # cut before its XML
    (tmp_path / "bench.log").write_text("| B | K | plain |\n|---|---|---|\n| 1 | 4 | 0.100 |\n# note\n")
    text, ok = gpu_report.report(tmp_path)
    assert not ok
    assert "tests-gpu: 3 run: 1 passed, 1 failed, 0 error, 1 skipped" in text
    assert "FAILED plugins.cuda.tests.test_gpu::test_graph_replays_never_sync: HostSyncError: a step synchronised" in text
    assert "tests-conformance: no JUnit XML" in text
    assert "multi-device (sampler on cuda:1): skipped: needs two GPUs" in text
    assert "graph stats: {'captures': 3}" in text and "| 1 | 4 | 0.100 |" in text and "# note" not in text


def test_a_clean_run_is_ok(tmp_path):
    (tmp_path / "sections.txt").write_text("setup: 20 s (limit 60 s, rc 0; 460 s of 480 left)\n")
    text, ok = gpu_report.report(tmp_path)
    assert ok and "no benchmark rows" in text and "not run" in text


def test_the_top_k_modules_background_build_is_reported(tmp_path):
    (tmp_path / "sections.txt").write_text("setup: 20 s (limit 60 s, rc 0; 460 s of 480 left)\n")
    (tmp_path / "topk-build.txt").write_text(
        "ninja: building\nFlashInfer's top-k module (top_k_first=True): built in 231.4 s\n")
    text, ok = gpu_report.report(tmp_path)
    assert ok and "top-k module (top_k_first=True): built in 231.4 s" in text
    (tmp_path / "topk-build.txt").write_text("Traceback ...\nRuntimeError: nvcc failed\n")
    assert "top-k module: its build printed no result" in gpu_report.report(tmp_path)[0]
    (tmp_path / "tests-top-k-first.log").write_text("..\n")            # cut before its XML
    assert "tests-top-k-first: no JUnit XML" in gpu_report.report(tmp_path)[0]
