"""Designing a ladder: which small runs, at how many tokens, for a compute budget.

Choice: separate runs per token budget, each with its own cosine schedule (the trainer's), not
one warmup-stable-decay run per model with cooldown branches. With the two token budgets per size
used here a WSD run with branches saves at most ~1/3 of the dense runs' compute (the stable phase
is shared, each branch still pays its cooldown, 10-20% of its length in Hagele et al. 2024, arXiv
2405.18392), it needs a second schedule whose cooldown length is itself a choice, and every point
would be a branch of a shared run. Separate runs keep every point the end of its own schedule, the
property the default fit relies on (scaling_fits/clark2022.py), and each run is one independent
trainer invocation that a killed ladder can resume or redo.

Runs (space `mosaic/data/default_ladder.yaml`): every fitted size i trains
  dense at D_hi / token_ratio and at D_hi  (the token dimension at every N),
  MoE (n_experts, top_k) at G = 1, D_hi    (sparsity at every N),
  odd i: that MoE at each G > 1, D_hi      (experts x G, top_k x G, d_expert / G: same N_tot, N_act),
  even i: the sparser MoE at G = 1, D_hi   (a second sparsity level);
and the held-out size trains the G = 1 MoE at D_hi: fitted on the others, it measures extrapolation.
D_hi follows from the budget: sum over runs of FLOPs/token x D = budget, FLOPs/token the trainer's
(`perfmodel.specs.architecture.model_flops_per_token`), D rounded to whole steps of gbs x seq_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from perfmodel.errors import InputError
from perfmodel.specs.architecture import MoEArchitecture, granularity, model_flops_per_token, sparsity, total_params
from perfmodel.specs.strict import check, load_spec

IntPair = tuple[int, int]


@dataclass(frozen=True)
class LadderSpace:
    """What `mosaic ladder` may train (the YAML keys; see mosaic/data/default_ladder.yaml)."""

    sizes: tuple[IntPair, ...]
    holdout_size: IntPair
    head_dim: int = 16
    seq_len: int = 128
    ffn_ratio: float = 4.0
    moe: IntPair = (8, 2)
    sparser_moe: IntPair = (16, 2)
    granularity: tuple[int, ...] = (1, 2, 4)
    token_ratio: float = 2.0
    mbs: int = 16
    gbs: int = 16
    lr: float = 3.0e-3
    warmup_fraction: float = 0.05
    min_steps: int = 100
    min_runs: int = 12
    eval_batches: int = 16

    def __post_init__(self) -> None:
        check(len(self.sizes) >= 2, "sizes", "needs >= 2 fitted sizes", "list [d_model, n_layers] pairs")
        for d, n in (*self.sizes, self.holdout_size):
            check(d >= self.head_dim and d % self.head_dim == 0 and n >= 1, "sizes",
                  f"[{d}, {n}]: d_model must be a multiple of head_dim={self.head_dim}, n_layers >= 1",
                  "fix the size")
        check(list(self.sizes) == sorted(self.sizes, key=lambda s: s[0] * s[0] * s[1]), "sizes",
              "must go from small to large", "sort them")
        check(1 in self.granularity and all(g >= 1 for g in self.granularity), "granularity",
              "must contain 1 and only values >= 1", "e.g. [1, 2, 4]")
        for name, (e, k) in (("moe", self.moe), ("sparser_moe", self.sparser_moe)):
            check(1 <= k < e, name, f"[{e}, {k}]: needs 1 <= top_k < n_experts", "e.g. [8, 2]")
        check(self.token_ratio > 1, "token_ratio", "must be > 1", "e.g. 2.0")
        check(self.gbs % self.mbs == 0 and self.mbs >= 1, "gbs", "must be a multiple of mbs", "e.g. mbs 16, gbs 16")
        check(0 <= self.warmup_fraction < 0.5 and self.lr > 0, "warmup_fraction", "must be in [0, 0.5)", "e.g. 0.05")
        check(self.min_steps >= 1 and self.min_runs >= 1 and self.eval_batches >= 1, "min_steps", "must be >= 1",
              "give positive counts")

    @property
    def tokens_per_step(self) -> int:
        return self.gbs * self.seq_len


@dataclass(frozen=True)
class LadderRun:
    """One rung of the ladder: a model, a token budget, its trainer settings."""

    name: str
    model: MoEArchitecture
    steps: int
    tokens: int
    heldout: bool
    kind: str
    """dense | moe | moe-g<G> | sparser"""

    @property
    def flops(self) -> float:
        return float(model_flops_per_token(self.model)) * self.tokens

    @property
    def n_total(self) -> float:
        return float(total_params(self.model))

    @property
    def sparsity(self) -> float:
        return float(sparsity(self.model))

    @property
    def granularity(self) -> float:
        return float(granularity(self.model)) if self.model.n_experts else 1.0


def default_space_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("mosaic") / "data" / "default_ladder.yaml"))


def load_ladder_space(path: Optional[str | Path] = None) -> LadderSpace:
    return load_spec(LadderSpace, path if path is not None else default_space_path())


def _model(space: LadderSpace, size: IntPair, vocab_size: int, experts: Optional[IntPair], g: int) -> MoEArchitecture:
    d, n_layers = size
    heads = d // space.head_dim
    ff = int(round(space.ffn_ratio * d))
    common = dict(n_layers=n_layers, d_model=d, n_heads=heads, n_kv_heads=heads, head_dim=space.head_dim,
                  vocab_size=vocab_size, seq_len=space.seq_len, ffn_ratio=space.ffn_ratio, gated_ffn=True,
                  tie_embeddings=False)
    if experts is None:
        return MoEArchitecture(**common, d_ff_dense=ff)
    e, k = experts
    if ff % g:
        raise InputError(f"ladder space: granularity {g} does not divide the FFN width {ff} of d_model {d}")
    return MoEArchitecture(**common, n_experts=e * g, top_k=k * g, d_expert=ff // g)


def shapes(space: LadderSpace, vocab_size: int) -> list[tuple[str, MoEArchitecture, float, bool]]:
    """(kind, model, relative token budget, held out) of every run, before the budget sets D."""
    out: list[tuple[str, MoEArchitecture, float, bool]] = []
    for i, size in enumerate(space.sizes):
        out.append(("dense", _model(space, size, vocab_size, None, 1), 1.0 / space.token_ratio, False))
        out.append(("dense", _model(space, size, vocab_size, None, 1), 1.0, False))
        out.append(("moe", _model(space, size, vocab_size, space.moe, 1), 1.0, False))
        if i % 2:
            for g in (g for g in space.granularity if g > 1):
                out.append((f"moe-g{g}", _model(space, size, vocab_size, space.moe, g), 1.0, False))
        else:
            out.append(("sparser", _model(space, size, vocab_size, space.sparser_moe, 1), 1.0, False))
    out.append(("moe", _model(space, space.holdout_size, vocab_size, space.moe, 1), 1.0, True))
    return out


def design(space: LadderSpace, budget_flops: float, vocab_size: int,
           corpus_tokens: Optional[int] = None) -> list[LadderRun]:
    """The runs of the ladder for a budget (raises InputError naming what to change)."""
    if not budget_flops > 0 or not math.isfinite(budget_flops):
        raise InputError(f"--budget-flops {budget_flops}: must be a positive number of FLOPs, e.g. 5e14")
    plan = shapes(space, vocab_size)
    if len(plan) < space.min_runs:
        raise InputError(f"ladder space: {len(plan)} runs, fewer than min_runs={space.min_runs} (a fit of the "
                         "4-D law needs them); add sizes or granularities")
    per_hi = sum(model_flops_per_token(m) * rel for _, m, rel, _ in plan)   # FLOPs of the ladder per token of D_hi
    tps = space.tokens_per_step
    shortest = min(rel for _, _, rel, _ in plan)
    need = per_hi * space.min_steps * tps / shortest
    d_hi = budget_flops / per_hi
    if d_hi * shortest < space.min_steps * tps:
        raise InputError(f"--budget-flops {budget_flops:.3g}: too small for the {len(plan)} runs of this ladder (the "
                         f"shortest would train {d_hi * shortest / tps:.0f} steps < min_steps={space.min_steps}); give "
                         f">= {need:.3g} FLOPs, or fewer sizes / smaller models in --space")
    runs = []
    for idx, (kind, model, rel, held) in enumerate(plan):
        steps = max(space.min_steps, int(round(d_hi * rel / tps)))
        tokens = steps * tps
        tag = "dense" if kind == "dense" else f"E{model.n_experts}k{model.top_k}"
        runs.append(LadderRun(name=f"r{idx:02d}-d{model.d_model}L{model.n_layers}-{tag}-{tokens // 1000}k",
                              model=model, steps=steps, tokens=tokens, heldout=held, kind=kind))
    if corpus_tokens is not None:
        longest = max(r.tokens for r in runs)
        if longest > corpus_tokens:
            raise InputError(f"--budget-flops {budget_flops:.3g}: the longest run would train {longest:,} tokens, more "
                             f"than the corpus's {corpus_tokens:,} training tokens (repeated data bends the token "
                             f"scaling); lower the budget to <= {budget_flops * corpus_tokens / longest:.3g} or give "
                             "more text")
    return runs


def min_budget_flops(space: LadderSpace, vocab_size: int) -> float:
    """The smallest budget the space accepts (its shortest run at min_steps)."""
    plan = shapes(space, vocab_size)
    per_hi = sum(model_flops_per_token(m) * rel for _, m, rel, _ in plan)
    return per_hi * space.min_steps * space.tokens_per_step / min(rel for _, _, rel, _ in plan)


__all__ = ["LadderRun", "LadderSpace", "default_space_path", "design", "load_ladder_space", "min_budget_flops",
           "shapes"]
