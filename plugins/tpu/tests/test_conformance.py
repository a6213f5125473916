"""The shared conformance suite on the tpu backend: on XLA (XLA:CPU in CI) and, without
torch-xla, the same traced code run eagerly on CPU tensors."""

from __future__ import annotations

from corelib.testing import ConformanceSuite

from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

#: The default buckets plus one that holds the rejection-sampling test's rows in one call:
#: 1024 rows x 3 slots, V = 16, so every token's expected count at slot 0 is at least 10 and
#: the acceptance rate's 5-sigma band is +-0.08. (The core's 4000 rows would make every batch
#: of the suite four times larger: a batch holds its largest bucket.) DRY's window only needs
#: to hold the suite's short histories.
BUCKETS = (8, 16, 32, 64, 128, 256, 1024)
VERIFY_ROWS = 1024
DRY_WINDOW = 64
#: The suite asks for 40 top logprobs and for every token (-1): the whole vocabulary (256).
MAX_LOGPROBS = 256


@needs_xla
class TestConformanceOnXla(ConformanceSuite):
    backend = "tpu"
    # 250 rows x 20 calls = 5,000 draws per chi-square test, in the 256-row bucket (each call
    # adds 250 requests: on XLA every add is a graph run over the 1024-row state).
    draw_rows = 250
    draw_calls = 20
    verify_rows = VERIFY_ROWS

    def make_sampler(self):
        return TpuSampler(xla_device(), buckets=BUCKETS, dry_window=DRY_WINDOW,
                          max_logprobs=MAX_LOGPROBS)


class TestTracedCodeOnCpu(ConformanceSuite):
    """The same stages run eagerly on CPU tensors: runs without torch-xla (any venv)."""

    backend = "tpu"
    draw_rows = 250
    draw_calls = 20
    verify_rows = VERIFY_ROWS

    def make_sampler(self):
        return TpuSampler("cpu", buckets=BUCKETS, dry_window=DRY_WINDOW,
                          max_logprobs=MAX_LOGPROBS)
