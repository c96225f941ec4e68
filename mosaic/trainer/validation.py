"""Validation loss on a held-out token file: every chunk once, the same count of forwards on every rank.

L_val = (sum over held-out target tokens of -log p) / (number of those tokens), nats per token,
without the load-balancing loss: the quantity a scaling-law fit uses. The held-out file is cut
into seq_len chunks exactly as the training file (labels never cross a document). Data-parallel
rank r evaluates chunks r, r + dp, r + 2 dp, ...; ranks with fewer real chunks run padding
micro-batches (no targets) so that every rank runs the same forwards, which FSDP's gathers and
the expert-parallel all-to-alls need. Each replica's sums are counted once (its tp rank 0).
Pipeline parallel is refused before launch (`config.eval_limits`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mosaic.trainer.data import IGNORE, Sample, TokenFile, collate


def _padding(seq_len: int) -> Sample:
    zeros = np.zeros(seq_len, dtype=np.int64)
    return Sample(tokens=zeros, labels=np.full(seq_len, IGNORE, dtype=np.int64), positions=np.arange(seq_len),
                  doc_ids=np.full(seq_len, -1, dtype=np.int64))


def rank_chunks(n_chunks: int, dp: int, dp_rank: int, mbs: int, max_batches: int = 0) -> list[list[int]]:
    """Chunk numbers of each of this rank's micro-batches (-1 = padding); same count on every rank."""
    n_eval = n_chunks if not max_batches else min(n_chunks, max_batches * mbs * dp)
    per_rank = math.ceil(n_eval / dp)
    mine = [dp_rank + dp * i for i in range(per_rank)]
    mine = [j if j < n_eval else -1 for j in mine]
    return [mine[i:i + mbs] + [-1] * (mbs - len(mine[i:i + mbs])) for i in range(0, per_rank, mbs)]


@torch.no_grad()
def validation_loss(module: torch.nn.Module, source: TokenFile, meshes: Any, device: torch.device, mbs: int,
                    autocast: Any, max_batches: int = 0) -> tuple[float, int]:
    """(mean cross-entropy over the held-out targets, number of targets), identical on every rank."""
    was_training = module.training
    module.eval()
    ce_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_sum = torch.zeros((), dtype=torch.float64, device=device)
    counted = 1.0 if meshes.tp_rank == 0 else 0.0
    try:
        for chunk_ids in rank_chunks(source.n_chunks, meshes.dp, meshes.dp_rank, mbs, max_batches):
            samples = [source.sample_chunk(j) if j >= 0 else _padding(source.seq_len) for j in chunk_ids]
            tokens, labels, positions, doc_ids = collate(samples)
            tokens, labels, positions = tokens.to(device), labels.to(device), positions.to(device)
            doc_ids = doc_ids.to(device) if doc_ids is not None else None
            with autocast:
                logits, _ = module(tokens, positions, doc_ids)
            ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
            ce_sum += ce.double() * counted
            n_sum += float((labels != IGNORE).sum()) * counted
    finally:
        module.train(was_training)
    stats = torch.stack([ce_sum, n_sum])
    dist.all_reduce(stats)   # NOTE: host-device sync below
    ce_total, n_total = stats.tolist()
    return (ce_total / n_total if n_total > 0 else float("nan")), int(n_total)


__all__ = ["rank_chunks", "validation_loss"]
