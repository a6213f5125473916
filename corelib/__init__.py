"""corelib: LLM logits to sampled tokens, one contract on every accelerator."""

__version__ = "0.1.0"

from .batch import SamplingBatch, StepState, UnknownRequestError
from .hookspecs import hookimpl, hookspec
from .params import SamplingParams
from .registry import (
    Availability,
    BackendSpec,
    BackendStatus,
    BackendUnavailableError,
    StageStatus,
    available_backends,
    available_stages,
    get_sampler,
)
from .outputs import ScoreOutput
from .sampler import Logprobs, Sampler, SamplerOutput, VerifyOutput
from .stages import StageError, StageInputs, StageSpec, StageState

__all__ = [
    "Availability", "BackendSpec", "BackendStatus", "BackendUnavailableError", "Logprobs",
    "Sampler", "SamplerOutput", "SamplingBatch", "SamplingParams", "ScoreOutput", "StageError", "StageInputs",
    "StageSpec", "StageState", "StageStatus", "StepState", "UnknownRequestError", "VerifyOutput",
    "available_backends", "available_stages", "get_sampler", "hookimpl", "hookspec",
    "__version__",
]
