"""Measured figures of the fused expert-parallel dispatchers, per fabric level of a cluster.

A cluster file's optional `ep_dispatch:` section gives, for each fused dispatcher
(`FUSED_DISPATCHERS`: DeepEP-style and HybridEP-style dispatch/combine kernels) and each
fabric level the expert-parallel group may span (keyed by the level's name), one
`EpDispatcherFigures`. They are derived from published dispatch/combine measurements by
`perfmodel.dispatch.derive_figures` (the rule and its tests live there); a dispatcher or a
level without figures is one the cluster cannot price, and a layout asking for it gets the
`dispatcher` reason (`perfmodel.evaluate`).

    ep_dispatch:
      hybridep:
        scale_out: {bandwidth_bytes_per_s: 52.5e9, latency_s: 2.2e-4, sm_fraction: 0.061, source: ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from perfmodel.specs.strict import check

FUSED_DISPATCHERS = ("deepep", "hybridep")
"""Megatron-Core's flex token dispatcher backends with fused dispatch/combine kernels."""


@dataclass(frozen=True)
class EpDispatcherFigures:
    """One fused dispatcher on one fabric level: time of a dispatch or combine moving B bytes in
    the dispatcher's own byte convention (`perfmodel.dispatch`) = latency_s + B / bandwidth."""

    bandwidth_bytes_per_s: float
    """Bytes per second per rank, as the measurements count them (received token rows inside a
    scale-up domain, bytes sent to other nodes across the scale-out network)."""
    latency_s: float
    """Fixed cost of one call beyond its bytes (launch, notify, synchronisation)."""
    sm_fraction: float
    """Share of the device's compute units the kernels occupy while they run (SMs, AI cores);
    compute that overlaps them runs that much slower."""
    source: str
    """Where the figures come from: the measurements and the derivation rule."""
    traffic: Literal["received", "off_node"] = "received"
    """What the bandwidth counts: the token rows a rank receives (inside a scale-up domain) or
    the rows it sends to other nodes (across the scale-out network)."""

    def __post_init__(self) -> None:
        check(math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0, "bandwidth_bytes_per_s",
              f"must be > 0, got {self.bandwidth_bytes_per_s}", "write bytes/s, e.g. 50.0e9")
        check(math.isfinite(self.latency_s) and self.latency_s >= 0, "latency_s", f"must be >= 0, got {self.latency_s}",
              "write seconds, e.g. 2.0e-5")
        check(0 <= self.sm_fraction < 1, "sm_fraction", f"must be in [0, 1), got {self.sm_fraction}",
              "write the share of compute units, e.g. 0.12")
        check(bool(self.source.strip()), "source", "is empty", "cite the measurements")
        check(self.traffic in ("received", "off_node"), "traffic", f"{self.traffic!r} is unknown",
              "use received or off_node")


__all__ = ["EpDispatcherFigures", "FUSED_DISPATCHERS"]
