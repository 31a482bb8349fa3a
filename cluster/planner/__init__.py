"""Goodput planning: which prefill/decode split and TP degrees serve a workload
best within a GPU budget (`pdserve plan --slo`)."""

from cluster.planner.search import Candidate, PlanResult, Workload, search

__all__ = ["Candidate", "PlanResult", "Workload", "search"]
