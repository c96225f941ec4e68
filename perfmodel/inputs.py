"""The inputs of `perfmodel.evaluate` as equal-length batches.

A single `MoEArchitecture` or `ParallelLayout` becomes a batch of one; a batch
of one is repeated to the other's length; `devices` defaults to each layout's
world size tp * cp * pp * dp. The formulas then work on float64 columns
(`as_float`), categorical codes and flags keeping their integer/bool types.
"""

from __future__ import annotations

from typing import Optional, TypeVar, Union

import numpy as np
from numpy.typing import ArrayLike

from perfmodel.errors import InputError
from perfmodel.specs.architecture import ArchBatch, MoEArchitecture
from perfmodel.specs.layout import LayoutBatch, ParallelLayout

Batch = TypeVar("Batch", ArchBatch, LayoutBatch)

CODE_FIELDS = ("dp_flavor", "recompute", "precision", "sequence_parallel", "gated_ffn", "tie_embeddings",
               "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap",
               "account_embedding", "account_loss", "pp_layout", "balanced_split", "dispatcher", "pad_to_capacity",
               "recompute_modules")
"""Columns that hold categorical codes or flags (kept as they are by `as_float`)."""


def broadcast_inputs(archs: Union[MoEArchitecture, ArchBatch], layouts: Union[ParallelLayout, LayoutBatch],
                     devices: Optional[ArrayLike]) -> tuple[ArchBatch, LayoutBatch, np.ndarray]:
    """(architectures, layouts, devices as float64) of one common length n."""
    if isinstance(archs, MoEArchitecture):
        archs = ArchBatch.stack([archs])
    if isinstance(layouts, ParallelLayout):
        if layouts.dp is None or layouts.gbs is None:
            if devices is None or np.ndim(devices) != 0:
                raise InputError("layout: dp/gbs are not resolved; call layout.resolve(devices) or pass devices=N")
            layouts = layouts.resolve(int(np.asarray(devices)))
        layouts = LayoutBatch.stack([layouts])
    if not isinstance(archs, ArchBatch) or not isinstance(layouts, LayoutBatch):
        raise InputError("evaluate: archs must be MoEArchitecture/ArchBatch and layouts ParallelLayout/LayoutBatch")
    n_a, n_l = len(archs), len(layouts)
    if n_a != n_l and 1 not in (n_a, n_l):
        raise InputError(f"evaluate: {n_a} architectures and {n_l} layouts; give equal lengths or one of either")
    n = n_l if n_a == 1 else n_a
    if n_a != n:
        archs = archs.take(np.zeros(n, dtype=np.int64))
    if n_l != n:
        layouts = layouts.take(np.zeros(n, dtype=np.int64))
    world = (np.asarray(layouts.tp) * layouts.cp * layouts.pp * layouts.dp).astype(float)
    dev = world if devices is None else np.broadcast_to(np.asarray(devices, dtype=float), (n,)).copy()
    return archs, layouts, dev


def as_float(batch: Batch) -> Batch:
    """The batch with its integer sizes as float64 once (the formulas work in floats;
    categorical codes and flags keep their types)."""
    values = {name: (value if name in CODE_FIELDS else np.asarray(value, dtype=float))
              for name, value in vars(batch).items()}
    return type(batch)(**values)
