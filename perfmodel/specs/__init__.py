"""Spec types: architecture (what), cluster (where), layout (how)."""

from perfmodel.specs.architecture import (
    ARCH_FIELDS,
    ArchBatch,
    MoEArchitecture,
    active_params,
    expert_sparsity,
    granularity,
    model_flops_per_token,
    model_flops_per_token_palm,
    sparsity,
    total_params,
)
from perfmodel.specs.cluster import (
    Accelerator,
    ClusterSpec,
    FabricLevel,
    Goodput,
    Overlap,
    Straggler,
)
from perfmodel.specs.layout import (
    DP_FLAVORS,
    LAYOUT_FIELDS,
    PRECISIONS,
    RECOMPUTE_MODES,
    LayoutBatch,
    ParallelLayout,
    parse_layout,
)
from perfmodel.specs.strict import load_spec, spec_to_dict, write_yaml_atomic

__all__ = [
    "ARCH_FIELDS", "Accelerator", "ArchBatch", "ClusterSpec", "DP_FLAVORS",
    "FabricLevel", "Goodput", "LAYOUT_FIELDS", "LayoutBatch", "MoEArchitecture", "Overlap",
    "PRECISIONS", "ParallelLayout", "RECOMPUTE_MODES", "Straggler", "active_params",
    "expert_sparsity", "granularity", "load_spec", "model_flops_per_token", "model_flops_per_token_palm", "parse_layout",
    "sparsity", "spec_to_dict", "total_params", "write_yaml_atomic",
]
