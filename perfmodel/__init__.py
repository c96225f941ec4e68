"""MOSAIC's analytical performance model (numpy only, no torch)."""

from perfmodel.clusters import load_cluster
from perfmodel.errors import InfeasibleError, InputError, MosaicError
from perfmodel.specs import ClusterSpec, MoEArchitecture, ParallelLayout, parse_layout

__all__ = [
    "ClusterSpec", "InfeasibleError", "InputError", "MoEArchitecture", "MosaicError",
    "ParallelLayout", "load_cluster", "parse_layout",
]
