"""Helpers shared by the cuda plugin's tests (a unique module name: ``conftest.py`` puts this
folder on sys.path, next to other plugins' test folders)."""

from __future__ import annotations

from corelib_cuda.probe import cuda_availability

GPU = cuda_availability()


class SpecWithoutAGpu:
    """For conformance classes that run the backend's code on CPU tensors. The kit's check
    that ``BackendSpec.differentiable_score`` is the sampler's reads the spec through
    ``choose``, which refuses a backend whose probe finds no GPU. The spec is the same with or
    without one, so without one it is read from the registry's statuses (what ``corelib
    info`` prints)."""

    def test_corelib_info_says_whose_score_gives_gradients(self, sampler):
        if GPU.available:
            return super().test_corelib_info_says_whose_score_gives_gradients(sampler)
        from corelib.registry import default_registry
        status = next(s for s in default_registry().statuses() if s.name == self.backend)
        assert status.spec is not None, status.reason
        assert status.spec.differentiable_score == type(sampler).differentiable_score
        assert status.score_gradients == ("own" if type(sampler).differentiable_score else "reference")
