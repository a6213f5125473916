"""corelib-cuda: the ``cuda`` backend of corelib (NVIDIA GPUs).

``corelib.get_sampler("cuda")`` builds a :class:`CudaSampler`; build one directly to choose the
device or the path (``CudaSampler("cpu", use_flashinfer=False)`` runs the torch path on CPU
tensors, as the tests do). FlashInfer is imported only when a sampler on a GPU is made.
"""

__version__ = "0.1.0"

from .batch import CudaBatch
from .graph import GraphedSampler
from .sampler import CudaSampler

__all__ = ["CudaBatch", "CudaSampler", "GraphedSampler", "__version__"]
