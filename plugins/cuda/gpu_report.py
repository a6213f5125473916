"""The summary of a GPU check (``plugins/cuda/gpu_check.sh``), built from the files its sections
left in the output folder, so that it is right for a run cut short too:

    python plugins/cuda/gpu_report.py OUT

``sections.txt`` (one line per finished section, its rc), ``env.txt`` (versions, the path, the
self-test times), ``topk-build.txt`` (FlashInfer's top-k module's background build), ``junit-*.xml`` (pytest's reports: counts, failures, the multi-device test's
outcome), ``tests-*.log`` (the graph stats line) and ``bench.log`` (the benchmark's table rows,
printed as each batch size finished). Exit status 0 when every section finished with rc 0.
"""

from __future__ import annotations

import pathlib
import re
import sys
import xml.etree.ElementTree as ET

MULTI_DEVICE_TEST = "test_a_sampler_on_a_second_gpu_captures_launches_and_replays_there"


def junit_cases(path: pathlib.Path) -> list[tuple[str, str, str]]:
    """(test id, outcome, message) per test case of one JUnit XML file; outcome is passed,
    failed, error or skipped."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or "").splitlines()[0][:160] if found.get("message") else ""
                break
        cases.append((name, outcome, message))
    return cases


def report(out: pathlib.Path) -> tuple[str, bool]:
    lines = ["== corelib-cuda GPU check =="]
    env = out / "env.txt"
    lines += env.read_text().splitlines()[:12] if env.exists() else ["(no start-up output)"]
    topk = out / "topk-build.txt"
    if topk.exists():
        lines += [line for line in topk.read_text().splitlines() if "top-k module" in line][-1:] or \
            ["FlashInfer's top-k module: its build printed no result"]
    sections = (out / "sections.txt").read_text().splitlines() if (out / "sections.txt").exists() else []
    lines += ["", "sections:"] + [f"  {s}" for s in sections]
    ok = bool(sections) and all(re.search(r"rc 0[;)]", s) for s in sections)
    multi = "not run (its section did not reach it)"
    for xml in sorted(out.glob("junit-*.xml")):
        section = xml.stem.removeprefix("junit-")
        try:
            cases = junit_cases(xml)
        except ET.ParseError as exc:
            lines.append(f"tests-{section}: unreadable JUnit XML ({exc})")
            ok = False
            continue
        counts = {k: sum(1 for _, o, _ in cases if o == k) for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"tests-{section}: {len(cases)} run: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        for name, outcome, message in cases:
            if outcome in ("failed", "error"):
                lines.append(f"  {outcome.upper()} {name}: {message}")
            if name.endswith(MULTI_DEVICE_TEST):
                multi = f"{outcome}{': ' + message if message else ''}"
    for name in ("gpu", "flashinfer", "conformance", "top-k-first"):
        if (out / f"tests-{name}.log").exists() and not (out / f"junit-{name}.xml").exists():
            lines.append(f"tests-{name}: no JUnit XML (pytest did not finish its report)")
            ok = False
    lines.append(f"multi-device (sampler on cuda:1): {multi}")
    for log in sorted(out.glob("tests-*.log")):
        lines += [line for line in log.read_text().splitlines() if line.startswith("graph stats:")][:2]
    bench = out / "bench.log"
    table = [line for line in bench.read_text().splitlines() if line.startswith("|")] if bench.exists() else []
    lines += ["", "benchmark, ms per call (engine table first, then sampling):"]
    lines += table or ["(no benchmark rows)"]
    return "\n".join(lines), ok


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    text, ok = report(pathlib.Path(argv[0]))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
