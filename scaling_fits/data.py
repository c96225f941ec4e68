"""Training-run data for fitting: loading, validation, the arrays the fitter uses.

A runs file (CSV, or Parquet with pyarrow installed) has one row per evaluation
point and named columns:

| column | required | meaning |
|---|---|---|
| `n_total` | or `n_active` + `sparsity` | total non-embedding parameters N_tot |
| `n_active` | optional | active non-embedding parameters per token N_act |
| `sparsity` | optional (0 if absent and the run is dense) | S = 1 - N_act/N_tot, in [0, 1) |
| `tokens` | yes | training tokens seen D |
| `loss` | yes | evaluation loss, nats per token, > 0 |
| `granularity` | optional (1) | G = d_ff_ref / d_expert |
| `n_experts`, `top_k` | optional | reported; a row with n_experts > 1 must give its sparsity |
| `weight` | optional (1) | weight of the row in the summed Huber loss |
| `run_id` | optional (one run per row) | rows of one training run share it; bootstrap, hold-out and leave-one-out act on runs |
| `source` | optional (one source) | corpus / tokenizer / evaluation set the loss was measured on; a joint fit can give each source its own irreducible loss (`FitOptions.per_source`) |

Other columns are an error (a misspelt `wieght` must not be ignored), except
`step`, `router_type` and any column starting with `note_`, which are carried
along and never used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from scaling_fits.errors import FitDataError

REQUIRED = ("tokens", "loss")
KNOWN = ("n_total", "n_active", "sparsity", "tokens", "loss", "granularity", "n_experts", "top_k", "weight", "run_id",
         "source")
CARRIED = ("step", "router_type")


@dataclass(frozen=True, eq=False)
class RunData:
    """Validated evaluation points as arrays (one entry per row)."""

    n_total: np.ndarray
    sparsity: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    granularity: np.ndarray
    weight: np.ndarray
    run_index: np.ndarray        # int run number per row, 0..n_runs-1
    run_ids: tuple[str, ...]     # label of each run number
    source: str = "<arrays>"
    sha256: str = ""
    source_index: Optional[np.ndarray] = None   # int source number per row (None: all 0)
    source_names: tuple[str, ...] = ("",)        # label of each source number (sorted)

    def __post_init__(self) -> None:
        if self.source_index is None:
            object.__setattr__(self, "source_index", np.zeros(self.loss.shape[0], dtype=int))

    @property
    def n_sources(self) -> int:
        return len(self.source_names)

    @property
    def n_points(self) -> int:
        return int(self.loss.shape[0])

    @property
    def n_runs(self) -> int:
        return len(self.run_ids)

    @property
    def n_active(self) -> np.ndarray:
        return self.n_total * (1.0 - self.sparsity)

    @property
    def compute_flops(self) -> np.ndarray:
        """C = 6 N_act D per point (Kaplan et al. 2020; attention FLOPs left out for ranking)."""
        return 6.0 * self.n_active * self.tokens

    def run_compute_flops(self) -> np.ndarray:
        """Largest C reached by each run (shape n_runs)."""
        out = np.zeros(self.n_runs)
        np.maximum.at(out, self.run_index, self.compute_flops)
        return out

    def subset_runs(self, keep: np.ndarray) -> RunData:
        """Rows of the runs where `keep` (bool, shape n_runs) is true; run numbers renumbered."""
        keep = np.asarray(keep, dtype=bool)
        rows = keep[self.run_index]
        new_number = np.cumsum(keep) - 1
        return RunData(self.n_total[rows], self.sparsity[rows], self.tokens[rows], self.loss[rows],
                       self.granularity[rows], self.weight[rows], new_number[self.run_index[rows]],
                       tuple(r for r, k in zip(self.run_ids, keep) if k), self.source, self.sha256,
                       self.source_index[rows], self.source_names)

    def subset_sources(self, names: tuple[str, ...]) -> RunData:
        """Rows of the named sources (run and source numbers renumbered)."""
        unknown = [n for n in names if n not in self.source_names]
        if unknown:
            raise FitDataError(f"{self.source}: no source {unknown[0]!r}; sources: {', '.join(self.source_names)}")
        wanted = np.isin(np.asarray(self.source_names, dtype=object)[self.source_index], list(names))
        keep = np.zeros(self.n_runs, dtype=bool)
        keep[np.unique(self.run_index[wanted])] = True
        sub = self.subset_runs(keep)
        labels = np.asarray(self.source_names, dtype=object)[sub.source_index]
        kept = tuple(n for n in self.source_names if n in set(labels))
        return RunData(sub.n_total, sub.sparsity, sub.tokens, sub.loss, sub.granularity, sub.weight, sub.run_index,
                       sub.run_ids, sub.source, sub.sha256, np.array([kept.index(x) for x in labels], dtype=int), kept)


def from_arrays(n_total: Any, tokens: Any, loss: Any, sparsity: Any = 0.0, granularity: Any = 1.0,
                weight: Any = 1.0, run_id: Optional[Any] = None, source: str = "<arrays>",
                source_id: Optional[Any] = None) -> RunData:
    """RunData from arrays (validated like a file); run_id None = every row its own run; source_id None = one source."""
    loss_arr = np.atleast_1d(np.asarray(loss, dtype=float))
    n = loss_arr.shape[0]

    def full(x: Any) -> np.ndarray:
        return np.broadcast_to(np.asarray(x, dtype=float), (n,)).copy()

    columns = {"n_total": full(n_total), "tokens": full(tokens), "loss": loss_arr, "sparsity": full(sparsity),
               "granularity": full(granularity), "weight": full(weight)}
    for name, values in columns.items():
        _check_column(source, name, values)
    ids = np.arange(n).astype(str) if run_id is None else np.broadcast_to(np.asarray(run_id).astype(str), (n,))
    labels, index = np.unique(ids, return_inverse=True)
    src = np.full(n, "") if source_id is None else np.broadcast_to(np.asarray(source_id).astype(str), (n,))
    src_labels, src_index = np.unique(src, return_inverse=True)
    pairs = np.unique(np.stack([index, src_index]), axis=1)
    if pairs.shape[1] != labels.size:
        run = labels[np.flatnonzero(np.bincount(pairs[0], minlength=labels.size) > 1)[0]]
        raise FitDataError(f"{source}: run {run!r} has rows of two sources; a run's rows share one source")
    digest = _hash_arrays(columns, ids if source_id is None else np.char.add(np.char.add(ids.astype(str), "\x01"), src))
    return RunData(columns["n_total"], columns["sparsity"], columns["tokens"], loss_arr, columns["granularity"],
                   columns["weight"], index.astype(int), tuple(str(x) for x in labels), source, digest,
                   src_index.astype(int), tuple(str(x) for x in src_labels))


def _hash_arrays(columns: dict[str, np.ndarray], ids: np.ndarray) -> str:
    h = hashlib.sha256()
    for name in sorted(columns):
        h.update(name.encode())
        h.update(np.ascontiguousarray(columns[name]).tobytes())
    h.update("\x00".join(ids.tolist()).encode())
    return h.hexdigest()


def _row_error(source: str, name: str, values: np.ndarray, bad: np.ndarray, problem: str, fix: str) -> FitDataError:
    row = int(np.flatnonzero(bad)[0])
    return FitDataError(f"{source}: column '{name}' row {row + 1} (data row, header not counted): {problem} "
                        f"({values[row]!r}); {fix}")


def _check_column(source: str, name: str, values: np.ndarray) -> None:
    bad = ~np.isfinite(values)
    if bad.any():
        raise _row_error(source, name, values, bad, "missing or not finite", "give a finite number")
    if name == "sparsity":
        bad = (values < 0) | (values >= 1)
        if bad.any():
            raise _row_error(source, name, values, bad, "outside [0, 1)",
                             "sparsity is S = 1 - N_act/N_tot, 0 for dense models")
        return
    if name == "weight":
        bad = values < 0
        if bad.any():
            raise _row_error(source, name, values, bad, "negative", "weights must be >= 0")
        return
    bad = values <= 0
    if bad.any():
        unit = {"loss": "nats per token", "tokens": "tokens seen", "granularity": "1 for standard experts"}
        raise _row_error(source, name, values, bad, "not positive", f"{name} must be > 0 ({unit.get(name, 'a count')})")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_csv(convert: Any, src: str | Path, dst: str | Path, missing: str, **kwargs: Any) -> Any:
    """Read a public CSV, `convert(frame, **kwargs)` it to runs columns, write `dst` atomically; returns the frame."""
    import pandas as pd

    from scaling_fits.fitfile import write_text_atomic

    src = Path(src)
    if not src.is_file():
        raise FitDataError(f"{src}: no such file; give {missing}")
    out = convert(pd.read_csv(src), **kwargs)
    write_text_atomic(Path(dst), out.to_csv(index=False, float_format="%.10g"))
    return out


def _read_table(path: Path) -> Any:
    import pandas as pd

    suffix = "".join(path.suffixes[-2:]).lower()
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            return pd.read_parquet(path)
        except ImportError:
            raise FitDataError(f"{path}: reading Parquet needs pyarrow; pip install 'mosaic-planner[parquet]' "
                               "or save the runs as CSV") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
            raise FitDataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    if path.suffix.lower() == ".csv" or suffix == ".csv.gz":
        try:
            return pd.read_csv(path, comment="#")
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
            raise FitDataError(f"{path}: not a readable CSV file ({exc}); one header row, comma separated") from None
    raise FitDataError(f"{path}: unknown runs file type '{path.suffix}'; use .csv, .csv.gz or .parquet")


def load_runs(path: str | Path) -> RunData:
    """Read and validate a runs file (columns: module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FitDataError(f"{path}: no such runs file; give a CSV or Parquet file of training runs")
    frame = _read_table(path)
    source = str(path)
    columns = [str(c).strip() for c in frame.columns]
    frame.columns = columns
    for name in columns:
        if name not in KNOWN and name not in CARRIED and not name.startswith("note_"):
            raise FitDataError(f"{source}: unknown column '{name}'; known columns: {', '.join(KNOWN)} "
                               f"(also carried unused: {', '.join(CARRIED)}, note_*); rename or remove it")
    for name in REQUIRED:
        if name not in columns:
            raise FitDataError(f"{source}: missing column '{name}'; required: tokens, loss, and n_total "
                               "or n_active + sparsity")
    if len(frame) == 0:
        raise FitDataError(f"{source}: no rows; give at least one evaluation point per run")

    def numeric(name: str) -> np.ndarray:
        import pandas as pd

        values = pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=float)
        bad = np.isnan(values) & frame[name].notna().to_numpy()
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise FitDataError(f"{source}: column '{name}' row {row + 1} (data row, header not counted): "
                               f"not a number ({frame[name].iloc[row]!r}); give a number")
        return values

    n = len(frame)
    has = set(columns)
    sparsity = numeric("sparsity") if "sparsity" in has else None
    n_active = numeric("n_active") if "n_active" in has else None
    n_total = numeric("n_total") if "n_total" in has else None
    if sparsity is not None:
        _check_column(source, "sparsity", sparsity)
    if n_total is None:
        if n_active is None or sparsity is None:
            raise FitDataError(f"{source}: missing column 'n_total'; give n_total, or n_active and sparsity")
        _check_column(source, "n_active", n_active)
        n_total = n_active / (1.0 - sparsity)
    else:
        _check_column(source, "n_total", n_total)
        if n_active is not None:
            _check_column(source, "n_active", n_active)
            implied = 1.0 - n_active / n_total
            if sparsity is None:
                bad = (implied < 0) | (implied >= 1)
                if bad.any():
                    raise _row_error(source, "n_active", n_active, bad, "larger than n_total or not positive",
                                     "n_active must be in (0, n_total]")
                sparsity = np.maximum(implied, 0.0)
            else:
                bad = np.abs(implied - sparsity) > 1e-3
                if bad.any():
                    raise _row_error(source, "sparsity", sparsity, bad,
                                     "disagrees with 1 - n_active/n_total by more than 0.001",
                                     "give either sparsity or n_active, or make them agree")
    if sparsity is None:
        if "n_experts" in has:
            experts = numeric("n_experts")
            bad = experts > 1
            if bad.any():
                raise _row_error(source, "n_experts", experts, bad, "an MoE row without sparsity",
                                 "add a 'sparsity' or 'n_active' column (S = 1 - N_act/N_tot)")
        sparsity = np.zeros(n)
    tokens = numeric("tokens")
    loss = numeric("loss")
    granularity = numeric("granularity") if "granularity" in has else np.ones(n)
    weight = numeric("weight") if "weight" in has else np.ones(n)
    for name in ("n_experts", "top_k"):
        if name in has:
            values = numeric(name)
            if not np.all(np.isnan(values) | (values >= 1)):
                raise _row_error(source, name, values, ~(np.isnan(values) | (values >= 1)), "below 1",
                                 f"{name} counts experts, >= 1")
    run_id = frame["run_id"].astype(str).to_numpy() if "run_id" in has else None
    source_id = None
    if "source" in has:
        if frame["source"].isna().any():
            row = int(np.flatnonzero(frame["source"].isna().to_numpy())[0])
            raise FitDataError(f"{source}: column 'source' row {row + 1} (data row, header not counted): empty; "
                               "name the corpus/tokenizer of every row, or drop the column")
        source_id = frame["source"].astype(str).to_numpy()
    data = from_arrays(n_total, tokens, loss, sparsity, granularity, weight, run_id, source, source_id)
    if not np.any(data.weight > 0):
        raise FitDataError(f"{source}: every weight is 0; at least one row must count")
    return RunData(data.n_total, data.sparsity, data.tokens, data.loss, data.granularity, data.weight,
                   data.run_index, data.run_ids, source, file_sha256(path), data.source_index, data.source_names)


def combine(parts: list[RunData], label: Optional[str] = None) -> RunData:
    """One RunData from several (e.g. one per public source); runs and sources keep their labels."""
    if not parts:
        raise FitDataError("combine: no runs data given")
    ids = np.concatenate([np.asarray(p.run_ids, dtype=object)[p.run_index] for p in parts]).astype(str)
    src = np.concatenate([np.asarray(p.source_names, dtype=object)[p.source_index] for p in parts]).astype(str)
    cat = {k: np.concatenate([getattr(p, k) for p in parts]) for k in
           ("n_total", "sparsity", "tokens", "loss", "granularity", "weight")}
    out = from_arrays(cat["n_total"], cat["tokens"], cat["loss"], cat["sparsity"], cat["granularity"], cat["weight"],
                      ids, label or " + ".join(p.source for p in parts), src)
    digest = hashlib.sha256("\x00".join(p.sha256 for p in parts).encode()).hexdigest()
    return RunData(out.n_total, out.sparsity, out.tokens, out.loss, out.granularity, out.weight, out.run_index,
                   out.run_ids, out.source, digest, out.source_index, out.source_names)


__all__ = ["CARRIED", "KNOWN", "REQUIRED", "RunData", "combine", "convert_csv", "file_sha256", "from_arrays",
           "load_runs"]
