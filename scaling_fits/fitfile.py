"""Fit files (versioned YAML, strictly loaded) and `FittedLaw`, the object the planner uses.

Schema, version 1 (unknown or missing keys are errors; `provenance` is free-form
information and never used for predictions)::

    version: 1
    law: mosaic4d                 # one of scaling_fits.laws.LAWS
    params: {a: ..., alpha: ...}  # every parameter of the law, formula names
    fixed: [eta]                  # parameters held at a prior (not fitted)
    ci_level: 0.95                # null without bootstrap
    ci: {a: [lo, hi], ...}        # bootstrap percentile intervals, or {}
    bootstrap:                    # null, or
      seed: 0
      params: [a, alpha, ...]     # column order of samples
      samples: [[...], ...]       # (n_boot, n_params), natural units
    metrics: {...}                # in-sample / hold-out / leave-one-out errors, diagnostics
    provenance: {...}             # sources, data hash, fit date, fitter settings, priors
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from scaling_fits.errors import FitDataError
from scaling_fits.laws import Law, get_law

FIT_VERSION = 1
TOP_KEYS = ("version", "law", "params", "fixed", "ci_level", "ci", "bootstrap", "metrics", "provenance")
BOOT_KEYS = ("seed", "params", "samples")
DEFAULT_FIT = "default_fit.yaml"


@dataclass(frozen=True, eq=False)
class FittedLaw:
    """A law with fitted parameters (and bootstrap samples when the fit made them)."""

    law: Law
    theta: np.ndarray                         # fit-space vector (log coefficients, exponents)
    bootstrap_theta: Optional[np.ndarray] = None   # (n_boot, P) fit space
    fixed: tuple[str, ...] = ()
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    ci_level: Optional[float] = None
    bootstrap_seed: Optional[int] = None
    metrics: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def name(self) -> str:
        """The law's name (`mosaic4d`, `chinchilla`, ...)."""
        return self.law.name

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.law.param_names

    @property
    def params(self) -> dict[str, float]:
        """Fitted parameters, formula names (``lambda``, not ``lambda_``)."""
        return dict(zip(self.law.param_names, (float(v) for v in self.law.natural(self.theta))))

    @property
    def params_tuple(self) -> Any:
        """The law's params NamedTuple (with its derived quantities)."""
        return self.law.params_from_theta(self.theta)

    @property
    def bootstrap_params(self) -> Optional[np.ndarray]:
        """(n_boot, n_params) bootstrap samples in natural units, columns in `param_names` order; or None."""
        return None if self.bootstrap_theta is None else self.law.natural(self.bootstrap_theta)

    def predict(self, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
        """Loss, broadcasting over the four inputs (N_tot, S, D, G)."""
        return self.law.predict_theta(self.theta, n_total, sparsity, tokens, granularity)

    def predict_bootstrap(self, n_total: Any, sparsity: Any, tokens: Any, granularity: Any = 1.0) -> np.ndarray:
        """Loss under every bootstrap sample: shape (n_boot, *broadcast shape of the inputs)."""
        if self.bootstrap_theta is None:
            raise FitDataError(f"fit '{self.source}' has no bootstrap samples; refit with `mosaic fit --bootstrap N`")
        return self.law.predict_theta(self.bootstrap_theta, n_total, sparsity, tokens, granularity)

    def content_hash(self) -> str:
        """sha256 (16 hex) of what predictions depend on: law, parameters, bootstrap samples."""
        boot = None if self.bootstrap_theta is None else [[_num(v) for v in row] for row in self.bootstrap_params]
        payload = {"version": FIT_VERSION, "law": self.name,
                   "params": {k: _num(v) for k, v in self.params.items()}, "bootstrap": boot}
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_mapping(self) -> dict[str, Any]:
        boot = None
        if self.bootstrap_theta is not None:
            boot = {"seed": self.bootstrap_seed, "params": list(self.param_names),
                    "samples": [[_num(v) for v in row] for row in self.bootstrap_params]}
        return {
            "version": FIT_VERSION,
            "law": self.name,
            "params": {k: _num(v) for k, v in self.params.items()},
            "fixed": list(self.fixed),
            "ci_level": self.ci_level,
            "ci": {k: [_num(lo), _num(hi)] for k, (lo, hi) in self.ci.items()},
            "bootstrap": boot,
            "metrics": _plain(self.metrics),
            "provenance": _plain(self.provenance),
        }


def _num(v: Any) -> float:
    """Plain float with full precision (YAML/JSON round trip exact)."""
    return float(v)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


# ---------------------------------------------------------------------------
# writing

def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename: a crash never leaves half a file."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FitDataError(f"{path}: folder {folder} does not exist; create it or choose another output path")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; a fit file is as readable as any other output
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dump_fit(fitted: FittedLaw) -> str:
    header = (f"# MOSAIC scaling-law fit ({fitted.name}); written by scaling_fits, loaded strictly.\n"
              f"# Formula: L = {fitted.law.formula}\n")
    body = yaml.safe_dump(fitted.to_mapping(), sort_keys=False, default_flow_style=None, width=120)
    return header + body


def write_fit(fitted: FittedLaw, path: str | Path) -> None:
    write_text_atomic(Path(path), dump_fit(fitted))


# ---------------------------------------------------------------------------
# loading

def default_fit_path() -> Path:
    return Path(str(resources.files("scaling_fits") / "data" / DEFAULT_FIT))


def _fail(source: str, key: str, problem: str, fix: str) -> FitDataError:
    return FitDataError(f"{source}: {key}: {problem}; {fix}")


def _number(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(source, key, f"expected a number, got {type(value).__name__}", "write a number")
    try:
        out = float(value)
    except ValueError:
        raise _fail(source, key, f"expected a number, got {value!r}", "write a number") from None
    if not math.isfinite(out):
        raise _fail(source, key, f"not finite ({value!r})", "write a finite number")
    return out


def from_mapping(data: Any, source: str = "<mapping>") -> FittedLaw:
    """Strict: a FittedLaw from a parsed fit file, or FitDataError naming the key and the fix."""
    if not isinstance(data, dict):
        raise FitDataError(f"{source}: expected a mapping with keys {', '.join(TOP_KEYS)}; is this a fit file?")
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        raise _fail(source, str(unknown[0]), "unknown key", f"remove it (keys: {', '.join(TOP_KEYS)})")
    missing = [k for k in TOP_KEYS if k not in data]
    if missing:
        raise _fail(source, missing[0], "missing key", "add it (see scaling_fits/fitfile.py for the schema)")
    if data["version"] != FIT_VERSION or isinstance(data["version"], bool):
        raise _fail(source, "version", f"unsupported version {data['version']!r}",
                    f"this MOSAIC reads version {FIT_VERSION}; refit with `mosaic fit`")
    if not isinstance(data["law"], str):
        raise _fail(source, "law", "expected a law name", "write e.g. mosaic4d")
    try:
        law = get_law(data["law"])
    except FitDataError as exc:
        raise FitDataError(f"{source}: law: {exc}") from None
    params = data["params"]
    if not isinstance(params, dict):
        raise _fail(source, "params", "expected a mapping of parameter -> value", "write name: value pairs")
    for k in params:
        if k not in law.param_names:
            raise _fail(source, f"params.{k}", f"not a parameter of {law.name}",
                        f"its parameters are {', '.join(law.param_names)}")
    for k in law.param_names:
        if k not in params:
            raise _fail(source, f"params.{k}", "missing", f"{law.name} needs {', '.join(law.param_names)}")
    values = {k: _number(source, f"params.{k}", params[k]) for k in law.param_names}
    for k, v in values.items():
        if law.is_coef(k) and v < 0:
            raise _fail(source, f"params.{k}", f"coefficient is negative ({v})", "coefficients are >= 0")
    theta = np.array([(math.log(v) if v > 0 else -math.inf) if law.is_coef(k) else v for k, v in values.items()])
    fixed = data["fixed"]
    if not isinstance(fixed, list) or any(f not in law.param_names for f in fixed):
        raise _fail(source, "fixed", "expected a list of parameter names of the law", "e.g. [eta], or []")
    ci_level = data["ci_level"]
    if ci_level is not None:
        ci_level = _number(source, "ci_level", ci_level)
        if not 0 < ci_level < 1:
            raise _fail(source, "ci_level", f"{ci_level} outside (0, 1)", "write e.g. 0.95")
    ci_raw = data["ci"]
    if not isinstance(ci_raw, dict):
        raise _fail(source, "ci", "expected a mapping parameter -> [lo, hi]", "write {} without bootstrap")
    ci: dict[str, tuple[float, float]] = {}
    for k, v in ci_raw.items():
        if k not in law.param_names:
            raise _fail(source, f"ci.{k}", f"not a parameter of {law.name}", f"use {', '.join(law.param_names)}")
        if not isinstance(v, list) or len(v) != 2:
            raise _fail(source, f"ci.{k}", "expected [lo, hi]", "write two numbers")
        ci[k] = (_number(source, f"ci.{k}[0]", v[0]), _number(source, f"ci.{k}[1]", v[1]))
    boot_theta = None
    seed = None
    boot = data["bootstrap"]
    if boot is not None:
        if not isinstance(boot, dict):
            raise _fail(source, "bootstrap", "expected a mapping or null", f"keys {', '.join(BOOT_KEYS)}")
        for k in boot:
            if k not in BOOT_KEYS:
                raise _fail(source, f"bootstrap.{k}", "unknown key", f"remove it (keys: {', '.join(BOOT_KEYS)})")
        for k in BOOT_KEYS:
            if k not in boot:
                raise _fail(source, f"bootstrap.{k}", "missing key", "add it")
        if list(boot["params"] or []) != list(law.param_names):
            raise _fail(source, "bootstrap.params", "columns differ from the law's parameters",
                        f"write [{', '.join(law.param_names)}]")
        samples = boot["samples"]
        if (not isinstance(samples, list) or not samples
                or any(not isinstance(r, list) or len(r) != len(law.param_names) for r in samples)):
            raise _fail(source, "bootstrap.samples", f"expected a non-empty list of rows of {len(law.param_names)} numbers",
                        "refit with `mosaic fit --bootstrap N`")
        nat = np.array([[_number(source, "bootstrap.samples", v) for v in row] for row in samples])
        coef = np.array([law.is_coef(k) for k in law.param_names])
        if np.any(nat[:, coef] < 0):
            raise _fail(source, "bootstrap.samples", "negative coefficient", "coefficients are >= 0")
        with np.errstate(divide="ignore"):
            boot_theta = np.where(coef, np.log(np.where(coef, nat, 1.0)), nat)
        seed = boot["seed"]
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _fail(source, "bootstrap.seed", "expected an integer or null", "write e.g. 0")
    metrics = data["metrics"]
    provenance = data["provenance"]
    if not isinstance(metrics, dict):
        raise _fail(source, "metrics", "expected a mapping", "write {} if none")
    if not isinstance(provenance, dict):
        raise _fail(source, "provenance", "expected a mapping", "write {} if none")
    return FittedLaw(law, theta, boot_theta, tuple(fixed), ci, ci_level, seed, metrics, provenance, source)


def load_fit(path: Optional[str | Path] = None) -> FittedLaw:
    """A fit file (None = the bundled default fit, scaling_fits/data/default_fit.yaml)."""
    p = default_fit_path() if path is None else Path(path)
    source = str(p)
    if not p.is_file():
        if path is None:
            raise FitDataError(f"{source}: the bundled default fit is missing; run "
                               "`python -m scaling_fits.make_default_fit` or reinstall mosaic-planner")
        raise FitDataError(f"{source}: no such fit file; give a file written by `mosaic fit -o`")
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml when present: ~10x faster on samples
        data = yaml.load(p.read_text(), Loader=loader)  # noqa: S506 - a safe loader either way
    except yaml.YAMLError as exc:
        raise FitDataError(f"{source}: not valid YAML ({str(exc).splitlines()[0]}); fix the syntax or refit") from None
    return from_mapping(data, source)


__all__ = ["FIT_VERSION", "FittedLaw", "default_fit_path", "dump_fit", "from_mapping", "load_fit", "write_fit",
           "write_text_atomic"]
