"""A stage added to the core's stage table alone runs on XLA: the template traces the
reference method into the step graph, its per-row field is a column of the scalar table, and
min-p and typical-p, which this backend runs inside later stages' conditionals, run in their
own where the table puts a stage after them (``MIN_P_IN_ROUTE``, ``TYPICAL_P_IN_XTC``)."""

from __future__ import annotations

import os

from corelib.testing.added_stage import expected_kept, run_added_stage


def test_a_stage_added_through_the_table_alone_runs_on_xla():
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    assert run_added_stage("tpu", timeout=900, env=env) == expected_kept()
