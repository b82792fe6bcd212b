"""``python -m ddtree doctor``: why an engine's acceptance is low.

Checks the drafter's config against the target, measures the reference
acceptance profile in ddtree (vLLM's definitions), the same profile with each
known integration fault injected, and ranks the faults by their distance to
what an engine reported (log lines or figures).
"""

from ddtree.apps.doctor.diagnose import DoctorReport, diagnose, plot, render
from ddtree.apps.doctor.engine_logs import (
    EngineProfile,
    parse_engine_log,
    profile_from_figures,
)
from ddtree.apps.doctor.faults import FAULTS

__all__ = [
    "FAULTS",
    "DoctorReport",
    "EngineProfile",
    "diagnose",
    "parse_engine_log",
    "plot",
    "profile_from_figures",
    "render",
]
