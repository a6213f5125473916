"""corelib-tpu: the sampling contract as a few fixed XLA graphs, through torch-xla.

Importing this package is cheap: torch-xla is imported only when a sampler is created (or a
function that needs it runs). ``TpuSampler`` and ``XlaSamplingBatch`` load on first access.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Buckets", "RecompilationError", "TpuSampler", "XlaSamplingBatch", "__version__"]


def __getattr__(name):  # lazy: keeps `import corelib_tpu` free of the sampler's imports
    if name in ("TpuSampler", "RecompilationError"):
        from . import sampler
        return getattr(sampler, name)
    if name == "XlaSamplingBatch":
        from .batch import XlaSamplingBatch
        return XlaSamplingBatch
    if name == "Buckets":
        from .buckets import Buckets
        return Buckets
    raise AttributeError(f"module 'corelib_tpu' has no attribute {name!r}")
