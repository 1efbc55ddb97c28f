"""Which GPUs to use: pure, a Topology and constraints in, ranked K-GPU sets with reasons out.

One module per step, in the order ``choose.recommend`` runs them: ``evidence`` (a probe report read into
groups kept apart and measured bandwidths), ``constraints`` (what a set is chosen by, and the GPUs left
out before any search), ``search`` (the exact search over set shapes), ``reasons`` (the words and the
result types) and ``document`` (the JSON). The names below are the package's public face, so callers
write ``from gputopo.recommend import recommend``.
"""

from gputopo.recommend.choose import recommend
from gputopo.recommend.constraints import (
    DEFAULT_MAX_USED_MIB,
    DEFAULT_TOP,
    Constraints,
    Exclusion,
    exclusions,
)
from gputopo.recommend.document import SCHEMA, candidate_dict, to_dict
from gputopo.recommend.evidence import FailedGroup, Measurement, ProbeEvidence, evidence_from_report
from gputopo.recommend.reasons import Bottleneck, Candidate, Recommendation

__all__ = [
    "DEFAULT_MAX_USED_MIB",
    "DEFAULT_TOP",
    "SCHEMA",
    "Bottleneck",
    "Candidate",
    "Constraints",
    "Exclusion",
    "FailedGroup",
    "Measurement",
    "ProbeEvidence",
    "Recommendation",
    "candidate_dict",
    "evidence_from_report",
    "exclusions",
    "recommend",
    "to_dict",
]
