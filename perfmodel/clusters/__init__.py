"""The bundled cluster library (package data) and the name-or-path loader."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

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


__all__ = ["bundled_cluster_paths", "load_cluster", "resolve_cluster_path"]
