"""The bundled cluster library (package data), the name-or-path loader, and the bundled
cluster that matches a device (`default_cluster_for_device`)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Optional

from perfmodel.errors import InputError
from perfmodel.specs.cluster import ClusterSpec, size_from_host
from perfmodel.specs.strict import load_spec


def bundled_cluster_paths() -> dict[str, Path]:
    """Name -> path of every bundled cluster file, sorted by name."""
    folder = resources.files(__name__)
    paths = {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}
    return dict(sorted(paths.items()))


def resolve_cluster_path(name_or_path: str) -> Path:
    """`ascend_superpod`, `ascend_superpod.yaml` or a file path; an existing path wins."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate
    bundled = bundled_cluster_paths()
    stem = candidate.name[:-5] if candidate.name.endswith(".yaml") else candidate.name
    if candidate.parent == Path(".") and stem in bundled:
        return bundled[stem]
    raise InputError(f"cluster '{name_or_path}' is neither a file nor a bundled cluster; "
                     f"bundled: {', '.join(bundled)} (see `mosaic clusters`)")


def load_cluster(name_or_path: str) -> ClusterSpec:
    """Load and validate a cluster; host-sized clusters (cpu_local) are sized now."""
    return size_from_host(load_spec(ClusterSpec, resolve_cluster_path(name_or_path)))


DEVICE_NAME_CLUSTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": ((r"\bGB300\b", "gb300_nvl72"), (r"\bGB200\b", "gb200_nvl72"), (r"\bB300\b", "b300"),
             (r"\bB200\b", "b200"), (r"\bH200\b", "h200"), (r"\bH800\b", "h800"), (r"\bH100\b", "h100"),
             (r"\bA100\b.*\b80GB\b", "a100_80gb"), (r"\bMI300X\b", "mi300x")),
    "npu": ((r"\bASCEND910B", "ascend_910b"),),
}
"""Device kind -> (pattern, bundled cluster) tried in order on the upper-cased device name that
torch reports (`torch.cuda.get_device_name`, `torch.npu.get_device_name`: e.g. "NVIDIA H100 80GB
HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X", "Ascend910B2"). Every
bundled GPU cluster is an SXM/OAM part in an NVLink/xGMI node (see each file's accelerator
name), so a name with a PCIe or NVL (PCIe card) token matches none (NOT_BUNDLED_FORM_FACTOR);
nor does an A100 without 80GB (the 40 GB part), nor a GH200 (its own memory and NVLink-C2C)."""

NOT_BUNDLED_FORM_FACTOR = r"\b(PCIE|NVL)\b"


class NoDefaultCluster(InputError):
    """No bundled cluster is the default for this device: `reason` says why, `choices` are the
    clusters its kind can match. The message names the parameter (`device_name`);
    `for_option(flag)` says the same to a user who left that flag out."""

    def __init__(self, device: str, device_name: Optional[str], reason: str) -> None:
        self.device, self.device_name, self.reason = device, device_name, reason
        self.choices = tuple(sorted({cluster for _, cluster in DEVICE_NAME_CLUSTERS[device]}))
        super().__init__(f"device_name {device_name!r}: {reason}; name one of {', '.join(self.choices)} "
                         "or a cluster file")

    def for_option(self, flag: str) -> str:
        return (f"{flag}: not given, and {self.reason}; give {flag} with one of {', '.join(self.choices)} or a "
                "cluster file (`mosaic clusters`)")


def default_cluster_for_device(device: str, device_name: Optional[str] = None) -> str:
    """The bundled cluster that describes one `device` ("cpu", "cuda" or "npu") named
    `device_name` (what torch reports for it; unused on cpu): cpu -> cpu_local (sized from the
    host when loaded); cuda and npu -> the first DEVICE_NAME_CLUSTERS pattern the name matches.
    Raises NoDefaultCluster when the name is missing or matches none (the caller then needs an
    explicit cluster)."""
    if device == "cpu":
        return "cpu_local"
    if device not in DEVICE_NAME_CLUSTERS:
        raise InputError(f"device {device!r}: not one of cpu, {', '.join(DEVICE_NAME_CLUSTERS)}")
    if not device_name:
        raise NoDefaultCluster(device, device_name, f"the {device} device's name is not known")
    name = device_name.upper()
    if not re.search(NOT_BUNDLED_FORM_FACTOR, name):
        for pattern, cluster in DEVICE_NAME_CLUSTERS[device]:
            if re.search(pattern, name):
                return cluster
    raise NoDefaultCluster(device, device_name, f"no bundled cluster describes the {device} device {device_name!r}")


__all__ = ["DEVICE_NAME_CLUSTERS", "NoDefaultCluster", "bundled_cluster_paths", "default_cluster_for_device",
           "load_cluster", "resolve_cluster_path"]
