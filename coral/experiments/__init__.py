"""Reproducible experiments over the allocator and baselines (`coral experiment NAME`)."""

from coral.experiments.allocation import EXPERIMENTS, ExperimentResult, run_experiment

__all__ = ["EXPERIMENTS", "ExperimentResult", "run_experiment"]
