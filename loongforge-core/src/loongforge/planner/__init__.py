"""Automatic parallel layout: memory and time models, the planner, calibration (see docs/planner.md)."""

from __future__ import annotations

from loongforge.planner.hardware import ClusterSpec, parse_bytes
from loongforge.planner.layouts import Candidate, RecomputePlan, SearchSpace
from loongforge.planner.memory import Coefficients, Workload, estimate_memory
from loongforge.planner.planner import Plan, plan
from loongforge.planner.timing import TimeCoefficients, estimate_time

__all__ = [
    "Candidate",
    "ClusterSpec",
    "Coefficients",
    "Plan",
    "RecomputePlan",
    "SearchSpace",
    "TimeCoefficients",
    "Workload",
    "estimate_memory",
    "estimate_time",
    "parse_bytes",
    "plan",
]
