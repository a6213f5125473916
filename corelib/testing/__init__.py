"""Testing tools for backend authors: the shared conformance suite."""

from .conformance import STAGE_CASES, ConformanceSuite, chi_square_p_value

__all__ = ["ConformanceSuite", "STAGE_CASES", "chi_square_p_value"]
