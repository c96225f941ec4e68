"""Converter: Chinchilla training runs (Hoffmann et al. 2022) as extracted by Epoch AI -> our runs columns.

Sources:
- Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (arXiv 2203.15556): dense
  runs on MassiveText (SentencePiece, 32,000 tokens), each trained with a cosine schedule set to its
  own length (the paper's approach 3 fits the final losses of these runs). Table A9 lists every model
  configuration: `data/chinchilla2022_table_a9.csv` (transcribed).
- Besiroglu, Erdil, Barnett, You 2024, "Chinchilla Scaling: A replication attempt" (arXiv 2404.10102):
  the (model size, training FLOPs, final loss) of 245 runs read off the paper's Figure 4, repository
  epoch-research/analyzing-chinchilla, `data/svg_extracted_data.csv` (commit 9225883). The repository
  carries no licence file; the rows are numbers read off a published figure and are used with
  attribution.

Conversion (one output row per run; every run ends its own schedule, so the token dimension
is measured by separate runs, not by checkpoints of one schedule):

- ``n_total``: non-embedding parameters of the Table A9 configuration whose reported size
  ("Parameters (million)", which counts embeddings) is the run's model size (matched to the nearest
  size, within 1 %: the extraction reads sizes to ~0.3 %; the two closest configurations, 1,424M
  and 1,429M, differ by 0.6 % in non-embedding parameters): n_layers x (4 d_model kv_size n_heads + 2 d_model ffw_size), the attention
  and feed-forward weights of the blocks, the same count as `n_total` of the Clark et al. data.
- ``tokens``: training FLOPs / (6 x reported model size), as Besiroglu et al. convert them.
- ``loss``: the extracted final loss; ``sparsity`` 0, ``granularity`` 1; ``source`` ``chinchilla2022``.
- Excluded: the five runs with the highest loss, as Besiroglu et al. do (all are models of 2.0B-6.8B
  parameters trained on 0.04-0.4 tokens per parameter at ~1e19 FLOPs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from scaling_fits.errors import FitDataError

SOURCE = ("Hoffmann et al. 2022, Training Compute-Optimal Large Language Models, arXiv 2203.15556 (Table A9 "
          "configurations, Figure 4 runs); points as extracted by Besiroglu et al. 2024, arXiv 2404.10102, "
          "repository epoch-research/analyzing-chinchilla data/svg_extracted_data.csv (commit 9225883)")
SOURCE_ID = "chinchilla2022"
TABLE_A9 = Path(__file__).resolve().parent / "data" / "chinchilla2022_table_a9.csv"
NEEDED = ("Model Size", "Training FLOP", "loss")
EXCLUDE_HIGHEST_LOSS = 5
OUTPUT_COLUMNS = ("run_id", "source", "n_total", "sparsity", "granularity", "tokens", "loss", "weight",
                  "note_params_reported", "note_training_flops")


def table_a9() -> Any:
    """Hoffmann et al. 2022 Table A9 with the non-embedding block parameters of each configuration."""
    import pandas as pd

    t = pd.read_csv(TABLE_A9, comment="#")
    t["n_nonembedding"] = t["n_layers"] * (4 * t["d_model"] * t["kv_size"] * t["n_heads"]
                                           + 2 * t["d_model"] * t["ffw_size"])
    return t


def convert(frame: Any, exclude_highest_loss: int = EXCLUDE_HIGHEST_LOSS) -> Any:
    """Epoch AI's extracted Figure 4 points (pandas DataFrame) -> runs DataFrame with OUTPUT_COLUMNS."""
    import pandas as pd

    missing = [c for c in NEEDED if c not in frame.columns]
    if missing:
        raise FitDataError(f"Chinchilla points: missing column(s) {', '.join(missing)}; give the unmodified "
                           "svg_extracted_data.csv of epoch-research/analyzing-chinchilla")
    df = frame[list(NEEDED)].dropna().reset_index(drop=True)
    df["row"] = np.arange(len(df))
    if exclude_highest_loss:
        df = df.drop(df["loss"].nlargest(exclude_highest_loss).index)
    table = table_a9()
    reported = table["parameters_million"].to_numpy(dtype=float) * 1e6
    size = df["Model Size"].to_numpy(dtype=float)
    nearest = np.abs(size[:, None] / reported[None, :] - 1.0).argmin(axis=1)
    off = np.abs(size / reported[nearest] - 1.0)
    if (off > 0.01).any():
        bad = float(size[int(np.argmax(off))])
        raise FitDataError(f"Chinchilla points: model size {bad:.4g} matches no Table A9 configuration within 1%")
    out = pd.DataFrame({
        "run_id": [f"{SOURCE_ID}-{int(r)}" for r in df["row"]],
        "source": SOURCE_ID,
        "n_total": table["n_nonembedding"].to_numpy(dtype=float)[nearest],
        "sparsity": 0.0,
        "granularity": 1.0,
        "tokens": df["Training FLOP"].to_numpy(dtype=float) / (6.0 * size),
        "loss": df["loss"].to_numpy(dtype=float),
        "weight": 1.0,
        "note_params_reported": size,
        "note_training_flops": df["Training FLOP"].to_numpy(dtype=float),
    })
    return out[list(OUTPUT_COLUMNS)].reset_index(drop=True)


def convert_file(src: str | Path, dst: str | Path, **kwargs: Any) -> Any:
    """Read Epoch AI's svg_extracted_data.csv, convert, write `dst` atomically; returns the frame."""
    from scaling_fits.data import convert_csv

    return convert_csv(convert, src, dst, "data/svg_extracted_data.csv of epoch-research/analyzing-chinchilla", **kwargs)


__all__ = ["OUTPUT_COLUMNS", "SOURCE", "SOURCE_ID", "convert", "convert_file", "table_a9"]
