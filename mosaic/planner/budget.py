"""The budget: devices x wall time on a cluster, and the two compute figures built from it.

  compute-optimal   C_model       = devices x peak(precision) x nominal MFU x eta_good x wall time
                                    (systems ignored: the classic scaling-law budget)
  cluster-optimal   C_deliverable = devices x peak x MFU(geometry, layout) x eta_good x wall time
                                    = model FLOP/s of the layout x eta_good x wall time
eta_good is `perfmodel.schedule.goodput` (fixed eta or Young/Daly from the node MTBF).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from perfmodel.errors import InputError, Param
from perfmodel.specs.cluster import ClusterSpec

DEFAULT_DAYS = 20.0
SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class Budget:
    """Devices and wall time of one training job."""

    devices: int
    wall_time_s: float
    days: Optional[float] = None
    hours: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"devices": self.devices}
        if self.hours is not None:
            out["hours"] = self.hours
        else:
            out["days"] = self.days
        out["wall_time_s"] = self.wall_time_s
        return out


def make_budget(cluster: ClusterSpec, devices: Optional[int] = None, days: Optional[float] = None,
                hours: Optional[float] = None) -> Budget:
    """Defaults: the cluster file's device count and 20 days."""
    if days is not None and hours is not None:
        raise InputError("give ", Param("days"), " or ", Param("hours"), ", not both")
    n = cluster.devices if devices is None else int(devices)
    if n < 1:
        raise InputError(Param("devices", n), ": must be >= 1")
    if n > cluster.devices:
        raise InputError(Param("devices", n), f" exceeds cluster '{cluster.name}' size {cluster.devices}; "
                         "use at most the cluster's count or edit its 'devices' key")
    if hours is not None:
        if not hours > 0:
            raise InputError(Param("hours", hours), ": must be > 0")
        return Budget(devices=n, wall_time_s=float(hours) * 3600.0, hours=float(hours))
    days = DEFAULT_DAYS if days is None else float(days)
    if not days > 0:
        raise InputError(Param("days", days), ": must be > 0")
    return Budget(devices=n, wall_time_s=days * SECONDS_PER_DAY, days=days)


def goodput(cluster: ClusterSpec, devices: int) -> float:
    """eta_good of a job of `devices` devices (perfmodel's Young/Daly or fixed eta)."""
    import perfmodel

    fn = getattr(perfmodel, "goodput", None)
    if fn is None:
        from perfmodel.schedule import goodput as fn
    return float(fn(cluster, devices))


def compute_optimal_flops(cluster: ClusterSpec, budget: Budget, nominal_mfu: float, precision: str) -> float:
    """C_model of the compute-optimal budget (systems ignored)."""
    peak = cluster.accelerator.peak(precision)
    return budget.devices * peak * nominal_mfu * goodput(cluster, budget.devices) * budget.wall_time_s


__all__ = ["DEFAULT_DAYS", "Budget", "compute_optimal_flops", "goodput", "make_budget"]
