"""What each training framework MOSAIC exports to can run, as named layout predicates: one table
per framework, read by its exporter (a plan it refuses) and by `mosaic plan --framework` (layouts
it cannot run are left out of the search).

Each rule reads the layout alone (scalar ParallelLayout or LayoutBatch rows) and cites where the
framework refuses the combination. What also reads the model stays in the exporter (MindSpeed's
all-dense pipeline stage, its uneven interleaved split), so a plan searched for a framework is
still checked there on export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from perfmodel.errors import InputError
from perfmodel.operators import (
    ALLGATHER,
    DEEPEP,
    FP8,
    FP16,
    FP32,
    FSDP,
    FULL,
    HYBRIDEP,
    MXFP8,
    dispatcher_code,
    dp_flavor_code,
    precision_code,
    recompute_code,
    recomputes,
)
from perfmodel.specs.layout import LayoutBatch, ParallelLayout
from perfmodel.specs.protocols import Flag, LayoutLike


def _a(x: object) -> np.ndarray:
    return np.asarray(x)


def tp_overlap_needs_sequence_parallel(lay: LayoutLike) -> Flag:
    """Megatron-LM validate_args: --tp-comm-overlap needs --sequence-parallel (and tp > 1)."""
    return ~_a(lay.tp_comm_overlap) | (_a(lay.sequence_parallel) & (_a(lay.tp) > 1))


def ep_overlap_without_full_recompute(lay: LayoutLike) -> Flag:
    """Megatron-Core TransformerConfig: --overlap-moe-expert-parallel-comm refuses full recompute."""
    return ~_a(lay.ep_comm_overlap) | (_a(recompute_code(lay)) != FULL)


def ep_overlap_needs_vpp_under_pp(lay: LayoutLike) -> Flag:
    """Megatron-Core TransformerConfig: the EP overlap schedule needs vpp where pp > 1."""
    return ~_a(lay.ep_comm_overlap) | ~((_a(lay.pp) > 1) & (_a(lay.vpp) == 1))


def ep_overlap_without_allgather(lay: LayoutLike) -> Flag:
    """Megatron-Core TransformerConfig: the EP overlap refuses the allgather dispatcher."""
    return ~_a(lay.ep_comm_overlap) | (_a(dispatcher_code(lay)) != ALLGATHER)


def ep_overlap_without_fp32(lay: LayoutLike) -> Flag:
    """Megatron-Core TransformerConfig: the EP overlap needs bf16 or fp16 training."""
    return ~_a(lay.ep_comm_overlap) | (_a(precision_code(lay)) != FP32)


def no_per_op_recompute(lay: LayoutLike) -> Flag:
    """Megatron-Core's --recompute-modules has no per-op policy (torchtitan's 'op')."""
    return ~_a(recomputes(lay, "op"))


def mindspeed_precision(lay: LayoutLike) -> Flag:
    """MindSpeed-LLM on Ascend 910B/910C trains in bf16: no fp8 / mxfp8 export."""
    return ~np.isin(_a(precision_code(lay)), (FP8, MXFP8))


def mindspeed_dispatcher(lay: LayoutLike) -> Flag:
    """MindSpeed-LLM (core_v0.12.1) has no DeepEP / HybridEP dispatcher (flex/DeepEP is CUDA-only)."""
    return ~np.isin(_a(dispatcher_code(lay)), (DEEPEP, HYBRIDEP))


def mindspeed_param_gather_with_grad_reduce(lay: LayoutLike) -> Flag:
    """Megatron core_v0.12.1 overlaps the parameter gather only with --overlap-grad-reduce."""
    return ~_a(lay.overlap_param_gather) | _a(lay.overlap_grad_reduce)


def mindspeed_ep_overlap_without_fsdp(lay: LayoutLike) -> Flag:
    """MindSpeed's custom FSDP is not combined with --moe-alltoall-overlap-comm."""
    return ~_a(lay.ep_comm_overlap) | (_a(dp_flavor_code(lay)) != FSDP)


def torchtitan_no_ep_overlap(lay: LayoutLike) -> Flag:
    """torchtitan v0.2.2 overlaps expert-parallel communication only in its DualPipeV schedule."""
    return ~_a(lay.ep_comm_overlap)


def torchtitan_etp(lay: LayoutLike) -> Flag:
    """torchtitan's expert parallel: etp = 1 or etp = tp (where ep > 1)."""
    return (_a(lay.ep) == 1) | (_a(lay.etp) == 1) | (_a(lay.etp) == _a(lay.tp))


def torchtitan_precision(lay: LayoutLike) -> Flag:
    """torchtitan trains in bfloat16 or float32 (training.mixed_precision_param), not fp16."""
    return _a(precision_code(lay)) != FP16


Rule = tuple[str, Callable[[LayoutLike], Flag], str]
"""(name, predicate: True where the framework runs the layout, message: "key 'layout.FIELD': why;
the fix", formatted with the layout's fields)."""

_EP_OVERLAP = "key 'layout.ep_comm_overlap': Megatron-Core's --overlap-moe-expert-parallel-comm refuses "
_EP_FIX = " (TransformerConfig); turn it off or change that"
_OP = ("key 'layout.recompute_modules': 'op' is torchtitan's per-op policy, which Megatron-Core has no "
       "--recompute-modules for; plan with Megatron's modules (e.g. core_attn) or export --format torchtitan")

FRAMEWORKS: dict[str, tuple[Rule, ...]] = {
    "megatron": (
        ("tp_overlap_needs_sequence_parallel", tp_overlap_needs_sequence_parallel,
         "key 'layout.tp_comm_overlap': Megatron overlaps tensor-parallel communication only under sequence "
         "parallel; set sequence_parallel=true or turn it off"),
        ("ep_overlap_without_full_recompute", ep_overlap_without_full_recompute, _EP_OVERLAP + "full recompute" + _EP_FIX),
        ("ep_overlap_needs_vpp_under_pp", ep_overlap_needs_vpp_under_pp,
         _EP_OVERLAP + "pp > 1 without vpp (pp={pp}, vpp={vpp})" + _EP_FIX),
        ("ep_overlap_without_allgather", ep_overlap_without_allgather, _EP_OVERLAP + "the allgather dispatcher" + _EP_FIX),
        ("ep_overlap_without_fp32", ep_overlap_without_fp32, _EP_OVERLAP + "fp32" + _EP_FIX),
        ("no_per_op_recompute", no_per_op_recompute, _OP),
    ),
    "mindspeed": (
        ("mindspeed_precision", mindspeed_precision,
         "key 'layout.precision': {precision} is not exported for MindSpeed-LLM (Ascend 910B/910C train in bf16); "
         "plan with precision bf16"),
        ("mindspeed_dispatcher", mindspeed_dispatcher,
         "key 'layout.dispatcher': {dispatcher} is not a MindSpeed-LLM dispatcher (core_v0.12.1 flex/DeepEP is "
         "CUDA-only); plan with dispatcher alltoall or allgather"),
        ("mindspeed_param_gather_with_grad_reduce", mindspeed_param_gather_with_grad_reduce,
         "key 'layout.overlap_param_gather': Megatron core_v0.12.1 (MindSpeed-LLM) overlaps the parameter gather "
         "only with overlap_grad_reduce; turn both on or both off"),
        ("mindspeed_ep_overlap_without_fsdp", mindspeed_ep_overlap_without_fsdp,
         "key 'layout.ep_comm_overlap': MindSpeed's custom FSDP is not combined with --moe-alltoall-overlap-comm; "
         "use zero1 or turn it off"),
        ("no_per_op_recompute", no_per_op_recompute, _OP),
    ),
    "torchtitan": (
        ("torchtitan_precision", torchtitan_precision,
         "key 'layout.precision': torchtitan trains in bfloat16 or float32 (training.mixed_precision_param), not "
         "fp16; plan with bf16"),
        ("torchtitan_etp", torchtitan_etp,
         "key 'layout.etp': torchtitan supports etp = 1 or etp = tp (tp={tp}), got {etp}; use etp=1 or etp=tp "
         "for torchtitan"),
        ("torchtitan_no_ep_overlap", torchtitan_no_ep_overlap,
         "key 'layout.ep_comm_overlap': torchtitan v0.2.2 overlaps expert-parallel communication only in the "
         "DualPipeV pipeline schedule; plan with ep_comm_overlap=false"),
    ),
}
"""The frameworks `mosaic plan --framework` and the exporters know, each with its rules."""


def rules(framework: str) -> tuple[Rule, ...]:
    """`framework`'s rules (InputError naming the known frameworks for another name)."""
    if framework not in FRAMEWORKS:
        raise InputError(f"--framework {framework}: unknown; use one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[framework]


def supported(framework: str, grid: LayoutBatch) -> np.ndarray:
    """Whether `framework` runs each row of `grid` (every rule of its table)."""
    ok = np.ones(len(grid), dtype=bool)
    for _, rule, _ in rules(framework):
        ok &= np.broadcast_to(np.asarray(rule(grid), dtype=bool), ok.shape)
    return ok


def refusals(framework: str, layout: ParallelLayout) -> list[str]:
    """The messages of the rules `framework` refuses `layout` by (empty: it runs it)."""
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    return [message.format(**fields) for _, rule, message in rules(framework) if not bool(np.all(rule(layout)))]


def check(framework: str, layout: ParallelLayout, source: str) -> None:
    """Raise InputError "SOURCE: key 'layout.FIELD': why; fix" for the first rule `layout` breaks."""
    problems = refusals(framework, layout)
    if problems:
        raise InputError(f"{source}: {problems[0]}")


__all__ = ["FRAMEWORKS", "check", "refusals", "rules", "supported"]
