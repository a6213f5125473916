"""The conformance suite's kept-set cases: each stage of the table with its example
parameters, and the combinations and edge cases the suite adds, with the contract rule each
checks. Shared by the checks of kept sets against the reference and of ``return_kept``.
"""

from __future__ import annotations

from .. import pipeline

# The kept-set cases, on random logits: each stage of the table (corelib.pipeline) with its
# example parameters, so a stage added to the table is checked on every backend at once, and
# the combinations and edge cases below.
COMBINED_CASES: dict[str, tuple[dict, str]] = {
    "top_k": (dict(top_k=20), "top_k"),
    "top_k_ties": (dict(top_k=5), "top_k"),
    "top_p": (dict(top_p=0.9), "top_p"),
    "top_p_small": (dict(top_p=0.2, temperature=0.5), "top_p"),
    "top_k_top_p_temperature": (dict(top_k=50, top_p=0.9, temperature=0.7), "filters"),
    "min_p_top_k_top_p": (dict(min_p=0.02, top_k=40, top_p=0.8, temperature=1.3), "filters"),
    "repetition_penalty": (dict(repetition_penalty=1.3), "repetition"),
    "frequency_presence": (dict(frequency_penalty=0.7, presence_penalty=-0.4), "freq_presence"),
    "greedy": (dict(temperature=0.0, top_k=3), "greedy_prep"),
    "dry_range_breakers": (dict(dry_multiplier=1.5, dry_allowed_length=1, dry_range=6,
                                dry_sequence_breakers=[100]), "dry"),
    "xtc_seeded_coin": (dict(xtc_probability=0.5, xtc_threshold=0.02, seed=77), "xtc"),
    "new_samplers": (dict(dry_multiplier=1.0, top_n_sigma=2.0, typical_p=0.9, xtc_probability=1.0,
                          xtc_threshold=0.05, top_k=60, temperature=1.2), "new_samplers"),
}
STAGE_CASES: dict[str, dict] = {
    **{stage.name: stage.example for stage in pipeline.STAGES if stage.example is not None},
    **{name: params for name, (params, _) in COMBINED_CASES.items()},
}
# Which rule each kept-set case checks.
STAGE_RULES: dict[str, str] = {
    **{stage.name: stage.name for stage in pipeline.STAGES if stage.example is not None},
    **{name: rule for name, (_, rule) in COMBINED_CASES.items()},
}
