"""Plan reports: a view model, a self-contained HTML page, the live dashboard router and rich terminal tables."""

from coral.report.adapters import inputs_from_sim, load_inputs
from coral.report.html import build_report, render_page
from coral.report.inputs import (
    EpochPoint,
    LatencySeries,
    ReportInputs,
    adapt_inputs,
    latency_from_requests,
)
from coral.report.view import view_model

__all__ = [
    "EpochPoint",
    "LatencySeries",
    "ReportInputs",
    "adapt_inputs",
    "build_report",
    "inputs_from_sim",
    "latency_from_requests",
    "load_inputs",
    "render_page",
    "view_model",
]
