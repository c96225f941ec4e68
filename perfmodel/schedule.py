"""Pipeline schedule, stage contents, straggler and goodput.

- Stages: L layers split evenly over pp stages (pp*vpp model chunks). The
  leading `n_dense_layers` are dense-FFN layers, so the first stage holds the
  most dense layers and the last the most MoE layers; the first also holds the
  embedding, the last the LM head (Megatron). Every other stage is bounded by
  one of these two (a middle stage has no more dense layers than the first, no
  more MoE layers than the last, and neither end block), so the step is
  priced on the slower of first and last.
- 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", sec. 2.2): a step is (m + (pp-1)/vpp)
  micro-batch slots of the slowest stage; the bubble is the (pp-1)/vpp extra
  slots; interleaving (vpp chunks per stage) sends vpp times the p2p messages.
- In-flight micro-batches (Megatron-LM `schedules.py` warm-up counts): plain
  1F1B holds pp - r micro-batches on stage r; interleaved holds
  ((pp-r-1)*2 + (vpp-1)*pp + 1)/vpp stage-equivalents, i.e. pp + (pp-1)/vpp on the
  first stage (Korthikanti et al. 2022's factor 1 + (pp-1)/(pp*vpp)); at most m.
- Straggler: the slowest of `nodes` nodes sets the step: 1 + cv*sqrt(2 ln nodes)
  (expected max of n Gaussians), `cluster.straggler.factor`.
- Goodput (Young 1974; Daly 2006): checkpoint every tau = sqrt(2*delta*M) with
  delta the blocking checkpoint time and M the job's MTBF = node MTBF / nodes;
  the fraction lost is delta/tau + (tau/2 + R)/M = sqrt(2*delta/M) + R/M.
"""

from __future__ import annotations

import numpy as np

from perfmodel.specs.architecture import n_ffn_dense_layers
from perfmodel.specs.cluster import ClusterSpec
from perfmodel.specs.protocols import ArchLike, LayoutLike, Values


def stage_layer_counts(arch: ArchLike, lay: LayoutLike) -> dict[str, dict[str, Values]]:
    """Blocks held by the first and the last pipeline stage (counts as floats/arrays).

    Returns {"first": {...}, "last": {...}} with keys attention, dense_ffn, moe,
    embedding, head. With pp = 1 both are the one stage (embedding and head).
    """
    pp = np.asarray(lay.pp, dtype=float)
    per_stage = np.asarray(arch.n_layers, dtype=float) / pp
    dense = np.asarray(n_ffn_dense_layers(arch), dtype=float)
    first_dense = np.minimum(dense, per_stage)
    last_dense = np.clip(dense - (pp - 1.0) * per_stage, 0.0, per_stage)
    single = pp == 1
    return {
        "first": {"attention": per_stage, "dense_ffn": first_dense, "moe": per_stage - first_dense,
                  "embedding": np.ones_like(pp), "head": np.where(single, 1.0, 0.0)},
        "last": {"attention": per_stage, "dense_ffn": last_dense, "moe": per_stage - last_dense,
                 "embedding": np.where(single, 1.0, 0.0), "head": np.ones_like(pp)},
    }


def micro_batches(lay: LayoutLike) -> Values:
    """m = gbs / (mbs * dp): micro-batches per step per pipeline (at least 1)."""
    return np.maximum(np.asarray(lay.gbs, dtype=float) / (np.asarray(lay.mbs, dtype=float) * lay.dp), 1.0)


def in_flight(lay: LayoutLike, stage: str) -> Values:
    """Micro-batches whose activations stage `first` (rank 0) or `last` holds at peak."""
    pp = np.asarray(lay.pp, dtype=float)
    vpp = np.asarray(lay.vpp, dtype=float)
    rank = np.zeros_like(pp) if stage == "first" else pp - 1.0
    plain = pp - rank
    interleaved = ((pp - rank - 1.0) * 2.0 + (vpp - 1.0) * pp + 1.0) / vpp
    held = np.where(vpp > 1, interleaved, plain)
    return np.minimum(held, micro_batches(lay))


def bubble_slots(lay: LayoutLike) -> Values:
    """Extra micro-batch slots of 1F1B: (pp - 1) / vpp (0 without a pipeline)."""
    return (np.asarray(lay.pp, dtype=float) - 1.0) / np.asarray(lay.vpp, dtype=float)


def nodes(cluster: ClusterSpec, devices: Values) -> Values:
    """Nodes a job of `devices` occupies (innermost fabric level = node)."""
    return np.ceil(np.asarray(devices, dtype=float) / cluster.node_devices)


def straggler_factor(cluster: ClusterSpec, devices: Values) -> Values:
    return cluster.straggler.factor(nodes(cluster, devices))


def checkpoint_interval_s(cluster: ClusterSpec, devices: Values) -> Values:
    """Young's optimal checkpoint interval sqrt(2 * delta * M) (inf without MTBF or delta)."""
    gp = cluster.goodput
    if gp.node_mtbf_hours is None or gp.checkpoint_s <= 0:
        return np.full(np.shape(devices), np.inf) if np.ndim(devices) else float("inf")
    mtbf_s = gp.node_mtbf_hours * 3600.0 / nodes(cluster, devices)
    return np.sqrt(2.0 * gp.checkpoint_s * mtbf_s)


def goodput(cluster: ClusterSpec, devices: Values) -> Values:
    """Fraction of wall time that trains, eta_good (the planner's C_deliverable factor).

    `eta` when the cluster file gives it; otherwise Young/Daly from the node MTBF:
    1 - sqrt(2*delta/M) - R/M with M = node MTBF / nodes, delta = checkpoint_s,
    R = restart_s, clipped to [0, 1].
    """
    gp = cluster.goodput
    if gp.eta is not None:
        out = np.full(np.shape(devices), float(gp.eta))
        return out if np.ndim(devices) else float(gp.eta)
    assert gp.node_mtbf_hours is not None  # Goodput holds exactly one of eta and node_mtbf_hours
    mtbf_s = gp.node_mtbf_hours * 3600.0 / nodes(cluster, devices)
    eta = 1.0 - np.sqrt(2.0 * gp.checkpoint_s / mtbf_s) - gp.restart_s / mtbf_s
    eta = np.clip(eta, 0.0, 1.0)
    return eta if np.ndim(devices) else float(eta)
