"""corelib's ``cpu`` backend: the contract's stages at close to memory speed on CPUs.

``corelib.get_sampler("cpu")`` builds it through the plugin entry point; importing this
package directly gives the classes for tests and benchmarks.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # The sampler loads torch-heavy modules; keep `import corelib_cpu` (and discovery) light.
    if name in ("CpuSampler",):
        from .sampler import CpuSampler
        return CpuSampler
    if name in ("CpuBatch",):
        from .batch import CpuBatch
        return CpuBatch
    raise AttributeError(f"module 'corelib_cpu' has no attribute {name!r}")


__all__ = ["CpuBatch", "CpuSampler", "__version__"]
