"""Testing tools for backend authors: the shared conformance suite (``ConformanceSuite``) and
the helpers its failure messages use, for a plugin's own checks."""

from .discovery import assert_entry_point
from .conformance import (RULES, STAGE_CASES, ConformanceSuite, chi_square_p_value,
                          params_text, violation)

__all__ = ["ConformanceSuite", "assert_entry_point", "RULES", "STAGE_CASES", "chi_square_p_value", "params_text",
           "violation"]
