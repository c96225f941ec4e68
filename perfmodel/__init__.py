"""MOSAIC's analytical performance model (numpy only, no torch)."""

from perfmodel.clusters import load_cluster
from perfmodel.errors import InfeasibleError, InputError, MosaicError
from perfmodel.evaluate import REASONS, EvalResult, evaluate
from perfmodel.schedule import goodput
from perfmodel.specs import ClusterSpec, MoEArchitecture, ParallelLayout, parse_layout

__all__ = [
    "REASONS", "EvalResult", "evaluate", "goodput",
    "ClusterSpec", "InfeasibleError", "InputError", "MoEArchitecture", "MosaicError",
    "ParallelLayout", "load_cluster", "parse_layout",
]
