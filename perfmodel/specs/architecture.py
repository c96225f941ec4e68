"""The model geometry (`MoEArchitecture`) and its derived quantities.

Every derived quantity is one pure function of an object with the
architecture's attributes. The functions use numpy arithmetic only, so the
same function serves a single `MoEArchitecture` (floats out) and an
`ArchBatch` of numpy arrays (arrays out): the vectorised performance model and
the planner call exactly these formulas.

Parameter counting (no biases, as in Llama/Mixtral/DeepSeek):
  attention   h*(h_q + 2*h_kv) + h_q*h      h_q = n_heads*head_dim, h_kv = n_kv_heads*head_dim
  MLA         (multi-head latent attention, DeepSeek-V2 arXiv 2405.04434 sec. 2.1; Megatron-Core
              `MLASelfAttention`), H heads, d_q = head_dim (query/key head: non-rope d_n + rope d_r),
              d_v = v_head_dim, ranks r_q (0: no query compression) and r_kv:
                q    r_q > 0: h*r_q + r_q (norm) + r_q*H*d_q;  r_q = 0: h*H*d_q
                kv   h*(r_kv + d_r) + r_kv (norm) + r_kv*H*(d_n + d_v)
                out  H*d_v*h
  FFN matrix  (3 if gated else 2) * h * width
  router      h * E
  norms       2*h per layer + h final
  embeddings  V*h input, + V*h LM head unless tied
Multi-token prediction (DeepSeek-V3 sec. 2.2; Megatron-Core `MultiTokenPredictionLayer`): each of
the n_mtp_layers modules has two input norms, a 2h -> h projection, one transformer layer of the
model's last layer type, a final norm, and shares the embedding and the LM head. Its parameters
(`mtp_params`) are not part of N_tot / N_act (DeepSeek-V3's 671B / 37B leave its 14B MTP weights
out); its FLOPs are part of the model FLOPs (as Megatron's `num_floating_point_operations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from perfmodel.memo import memoised
from perfmodel.specs.protocols import ArchLike, Values, rows_of
from perfmodel.specs.strict import check

CORE_ARCH_FIELDS = (
    "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "seq_len",
    "n_experts", "top_k", "n_shared_experts", "d_expert", "d_ff_dense", "n_dense_layers",
    "ffn_ratio", "gated_ffn", "tie_embeddings",
)
"""The fields every model file and runs CSV row gives."""
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
"""Multi-head latent attention (optional; kv_lora_rank > 0 turns it on)."""
MTP_FIELDS = ("n_mtp_layers",)
"""Multi-token prediction modules (optional)."""
ARCH_FIELDS = CORE_ARCH_FIELDS + MLA_FIELDS + MTP_FIELDS
OPTIONAL_ARCH_FIELDS = MLA_FIELDS + MTP_FIELDS


@dataclass(frozen=True)
class MoEArchitecture:
    """A decoder-only transformer with optional routed-expert FFN layers."""

    n_layers: int
    """L: transformer blocks."""
    d_model: int
    """h: residual width."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (GQA); equal to n_heads for MHA."""
    head_dim: int
    """Width of one head."""
    vocab_size: int
    """V: vocabulary size."""
    seq_len: int
    """s: training sequence length."""
    n_experts: int = 0
    """E: routed experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    """k: routed experts per token (0 for a dense model)."""
    n_shared_experts: int = 0
    """E_s: always-active experts of width d_expert."""
    d_expert: int = 0
    """Hidden width of one expert (0 for a dense model)."""
    d_ff_dense: int = 0
    """Hidden width of the dense FFN used by dense layers (and all layers when n_experts = 0)."""
    n_dense_layers: int = 0
    """Leading layers with a dense FFN instead of MoE (DeepSeek's first_k_dense)."""
    ffn_ratio: float = 4.0
    """d_ff_ref = ffn_ratio * d_model; granularity G = d_ff_ref / d_expert."""
    gated_ffn: bool = True
    """SwiGLU-style FFN (3 matrices) instead of a plain 2-matrix MLP."""
    tie_embeddings: bool = False
    """LM head shares the input embedding matrix."""
    # Multi-head latent attention (MLA_FIELDS): on when kv_lora_rank > 0. Then head_dim is the
    # query/key head width (its non-rope part d_n = head_dim - qk_rope_head_dim) and n_kv_heads
    # equals n_heads (every head gets its own key and value from the shared latent).
    q_lora_rank: int = 0
    """MLA query compression rank r_q (0: queries projected from h directly, DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    """MLA key/value compression rank r_kv (DeepSeek-V3: 512); 0 = standard attention."""
    qk_rope_head_dim: int = 0
    """MLA: the decoupled rotary part d_r of each query/key head (DeepSeek-V3: 64 of 192)."""
    v_head_dim: int = 0
    """MLA: width d_v of each value head (DeepSeek-V3: 128)."""
    n_mtp_layers: int = 0
    """Multi-token prediction modules after the last layer (DeepSeek-V3: 1)."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "seq_len"):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}", "give a positive integer")
        for name in ("n_experts", "top_k", "n_shared_experts", "d_expert", "d_ff_dense", "n_dense_layers"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}", "give 0 or a positive integer")
        check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"{self.n_kv_heads} does not divide n_heads={self.n_heads}", "use a divisor of n_heads")
        check(self.ffn_ratio > 0, "ffn_ratio", f"must be > 0, got {self.ffn_ratio}", "use e.g. 4.0 (or 8/3 for SwiGLU)")
        check(self.n_dense_layers <= self.n_layers, "n_dense_layers",
              f"{self.n_dense_layers} exceeds n_layers={self.n_layers}", "use at most n_layers")
        if self.n_experts == 0:
            check(self.d_ff_dense >= 1, "d_ff_dense", "a dense model (n_experts: 0) needs d_ff_dense >= 1",
                  "set d_ff_dense to the FFN width")
            check(self.top_k == 0 and self.n_shared_experts == 0, "top_k",
                  "a dense model (n_experts: 0) cannot route", "set top_k: 0 and n_shared_experts: 0")
        else:
            check(1 <= self.top_k <= self.n_experts, "top_k",
                  f"{self.top_k} must be in [1, n_experts={self.n_experts}]", "pick top_k between 1 and n_experts")
            check(self.d_expert >= 1, "d_expert", "an MoE model needs d_expert >= 1", "set d_expert to the expert width")
            if self.n_dense_layers > 0:
                check(self.d_ff_dense >= 1, "d_ff_dense", "n_dense_layers > 0 needs d_ff_dense >= 1",
                      "set d_ff_dense to the dense FFN width")
        for name in MLA_FIELDS + MTP_FIELDS:
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}", "give 0 or a positive integer")
        if self.kv_lora_rank == 0:
            for name in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                check(getattr(self, name) == 0, name, "is an MLA field but kv_lora_rank is 0 (standard attention)",
                      "set kv_lora_rank (e.g. 512) for multi-head latent attention, or remove " + name)
        else:
            for name in ("kv_lora_rank", "q_lora_rank"):
                check(getattr(self, name) < self.d_model, name,
                      f"{getattr(self, name)} is not smaller than d_model={self.d_model} (a latent rank compresses h)",
                      "use a rank below d_model (DeepSeek-V3: q 1536, kv 512 of 7168)")
            check(self.n_kv_heads == self.n_heads, "n_kv_heads",
                  f"MLA gives every head its own key and value: n_kv_heads={self.n_kv_heads} != n_heads={self.n_heads}",
                  f"set n_kv_heads: {self.n_heads}")
            check(self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
                  f"{self.qk_rope_head_dim} must be even and below head_dim={self.head_dim} (the query/key head "
                  "width, rope part included)", "DeepSeek-V3: head_dim 192 = 128 + qk_rope_head_dim 64")
            check(self.v_head_dim >= 1, "v_head_dim", "MLA needs v_head_dim >= 1", "DeepSeek-V3: 128")

    # Convenience methods: the pure functions below are the definitions.
    def total_params(self, embeddings: bool = False) -> float:
        return float(total_params(self, embeddings))

    def active_params(self, embeddings: bool = False) -> float:
        return float(active_params(self, embeddings))

    @property
    def sparsity(self) -> float:
        return float(sparsity(self))

    @property
    def granularity(self) -> float:
        return float(granularity(self))

    @property
    def model_flops_per_token(self) -> float:
        return float(model_flops_per_token(self))

    @property
    def model_flops_per_token_palm(self) -> float:
        return float(model_flops_per_token_palm(self))

    @property
    def uses_mla(self) -> bool:
        return bool(uses_mla(self))

    def replace(self, **changes: Any) -> MoEArchitecture:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ArchBatch:
    """Column-wise numpy arrays of many architectures (same attribute names)."""

    n_layers: np.ndarray
    d_model: np.ndarray
    n_heads: np.ndarray
    n_kv_heads: np.ndarray
    head_dim: np.ndarray
    vocab_size: np.ndarray
    seq_len: np.ndarray
    n_experts: np.ndarray
    top_k: np.ndarray
    n_shared_experts: np.ndarray
    d_expert: np.ndarray
    d_ff_dense: np.ndarray
    n_dense_layers: np.ndarray
    ffn_ratio: np.ndarray
    gated_ffn: np.ndarray
    tie_embeddings: np.ndarray
    q_lora_rank: Optional[np.ndarray] = None
    """MLA and MTP columns (OPTIONAL_ARCH_FIELDS); None = 0 for every row."""
    kv_lora_rank: Optional[np.ndarray] = None
    qk_rope_head_dim: Optional[np.ndarray] = None
    v_head_dim: Optional[np.ndarray] = None
    n_mtp_layers: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        for name in OPTIONAL_ARCH_FIELDS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(np.shape(self.n_layers), dtype=np.int64))

    @staticmethod
    def stack(archs: Sequence[MoEArchitecture]) -> ArchBatch:
        cols = {}
        for name in ARCH_FIELDS:
            values = [getattr(a, name) for a in archs]
            dtype = bool if name in ("gated_ffn", "tie_embeddings") else (float if name == "ffn_ratio" else np.int64)
            cols[name] = np.asarray(values, dtype=dtype)
        return ArchBatch(**cols)

    def __len__(self) -> int:
        return int(np.size(self.n_layers))

    def row(self, i: int) -> MoEArchitecture:
        values = {name: getattr(self, name)[i].item() for name in ARCH_FIELDS}
        return MoEArchitecture(**values)

    def take(self, index: Union[int, slice, np.ndarray]) -> ArchBatch:
        return ArchBatch(**{name: rows_of(getattr(self, name), index) for name in ARCH_FIELDS})


# ---------------------------------------------------------------------------
# Derived quantities: pure functions over MoEArchitecture or ArchBatch.

@memoised
def ffn_matrices(arch: ArchLike) -> Values:
    """Weight matrices per FFN: 3 for gated (SwiGLU), 2 for a plain MLP."""
    return np.where(arch.gated_ffn, 3, 2)


@memoised
def n_moe_layers(arch: ArchLike) -> Values:
    """Layers whose FFN is routed (0 for a dense model)."""
    return np.where(np.asarray(arch.n_experts) > 0, np.asarray(arch.n_layers) - arch.n_dense_layers, 0)


@memoised
def n_ffn_dense_layers(arch: ArchLike) -> Values:
    """Layers whose FFN is the dense d_ff_dense MLP."""
    return np.asarray(arch.n_layers) - n_moe_layers(arch)


def uses_mla(arch: ArchLike) -> Values:
    """Multi-head latent attention is on (kv_lora_rank > 0)."""
    return np.asarray(arch.kv_lora_rank) > 0


def mla_attention_params(arch: ArchLike) -> Values:
    """MLA projections and latent norms of one layer (module doc): q (compressed or direct),
    kv down + norm + up, output; 0 without MLA."""
    h = np.asarray(arch.d_model)
    heads, d_q, d_r = np.asarray(arch.n_heads), np.asarray(arch.head_dim), np.asarray(arch.qk_rope_head_dim)
    r_q, r_kv, d_v = np.asarray(arch.q_lora_rank), np.asarray(arch.kv_lora_rank), np.asarray(arch.v_head_dim)
    q = np.where(r_q > 0, h * r_q + r_q + r_q * heads * d_q, h * heads * d_q)
    kv = h * (r_kv + d_r) + r_kv + r_kv * heads * (d_q - d_r + d_v)
    return np.where(r_kv > 0, q + kv + heads * d_v * h, 0)


@memoised
def attention_params_per_layer(arch: ArchLike) -> Values:
    """QKV + output projections: h*(h_q + 2*h_kv) + h_q*h; MLA: `mla_attention_params`."""
    h_q = np.asarray(arch.n_heads) * arch.head_dim
    h_kv = np.asarray(arch.n_kv_heads) * arch.head_dim
    mha = np.asarray(arch.d_model) * (h_q + 2 * h_kv) + h_q * arch.d_model
    mla = uses_mla(arch)
    return np.where(mla, mla_attention_params(arch), mha) if np.any(mla) else mha


@memoised
def expert_params(arch: ArchLike) -> Values:
    """Parameters of one expert (routed or shared): (2|3) * h * d_expert."""
    return ffn_matrices(arch) * np.asarray(arch.d_model) * arch.d_expert


@memoised
def dense_ffn_params(arch: ArchLike) -> Values:
    """Parameters of one dense FFN: (2|3) * h * d_ff_dense."""
    return ffn_matrices(arch) * np.asarray(arch.d_model) * arch.d_ff_dense


@memoised
def router_params(arch: ArchLike) -> Values:
    return np.asarray(arch.d_model) * arch.n_experts


def norm_params(arch: ArchLike) -> Values:
    """Two RMSNorm weights per layer plus the final norm."""
    return np.asarray(arch.d_model) * (2 * np.asarray(arch.n_layers) + 1)


def embedding_params(arch: ArchLike) -> Values:
    """Input embedding plus the LM head unless tied."""
    per_matrix = np.asarray(arch.vocab_size) * arch.d_model
    return per_matrix * np.where(arch.tie_embeddings, 1, 2)


def _moe_layer_params(arch: ArchLike, routed_experts: Values) -> Values:
    return router_params(arch) + (routed_experts + np.asarray(arch.n_shared_experts)) * expert_params(arch)


def total_params(arch: ArchLike, embeddings: bool = False) -> Values:
    """N_tot: every parameter (non-embedding unless `embeddings`)."""
    body = (
        np.asarray(arch.n_layers) * attention_params_per_layer(arch)
        + n_ffn_dense_layers(arch) * dense_ffn_params(arch)
        + n_moe_layers(arch) * _moe_layer_params(arch, np.asarray(arch.n_experts))
        + norm_params(arch)
    )
    return body + embedding_params(arch) if embeddings else body


def active_params(arch: ArchLike, embeddings: bool = False) -> Values:
    """N_act: parameters one token passes through (top_k routed + shared experts)."""
    body = (
        np.asarray(arch.n_layers) * attention_params_per_layer(arch)
        + n_ffn_dense_layers(arch) * dense_ffn_params(arch)
        + n_moe_layers(arch) * _moe_layer_params(arch, np.asarray(arch.top_k))
        + norm_params(arch)
    )
    return body + embedding_params(arch) if embeddings else body


def model_card_active_params(arch: ArchLike) -> Values:
    """Activated parameters as model cards count them: N_act + the LM head (V h), the weights a
    token's forward multiplies by; the input embedding is a row lookup, not counted (tied: the
    head is that matrix, counted once). MTP modules are left out, as from the cards' totals.
    The convention of DeepSeek, Qwen and Moonshot, checked at their cards' precision: DeepSeek-V3
    36.62B -> "37B", Qwen3-235B 21.57B -> "22B", Kimi K2 31.69B -> "32B"; with the input embedding
    counted too, V3 (37.55B) and K2 (32.86B) would round to 38B and 33B. Mistral counts it:
    Mixtral 8x7B's "12.9B" is active_params(embeddings=True), 12.88B."""
    return active_params(arch) + np.asarray(arch.vocab_size) * arch.d_model


def mtp_params(arch: ArchLike, active: bool = False) -> Values:
    """Parameters of the multi-token prediction modules (all or `active` per token): per module
    two input norms + final norm (3h), the 2h -> h projection, one layer of the model's last
    layer type (MoE when the model has MoE layers); embedding and LM head are shared."""
    h = np.asarray(arch.d_model)
    moe = n_moe_layers(arch) > 0
    routed = np.asarray(arch.top_k) if active else np.asarray(arch.n_experts)
    ffn = np.where(moe, _moe_layer_params(arch, routed), dense_ffn_params(arch))
    layer = attention_params_per_layer(arch) + 2 * h + ffn
    return np.asarray(arch.n_mtp_layers) * (layer + 3 * h + 2 * h * h)


def sparsity(arch: ArchLike) -> Values:
    """S = 1 - N_act/N_tot (non-embedding): fraction of parameters inactive per token."""
    return 1.0 - active_params(arch) / total_params(arch)


def expert_sparsity(arch: ArchLike) -> Values:
    """1 - k/E (Abnar et al. 2025's S); 0 for dense models."""
    n_experts = np.asarray(arch.n_experts)
    return np.where(n_experts > 0, 1.0 - np.asarray(arch.top_k) / np.maximum(n_experts, 1), 0.0)


def granularity(arch: ArchLike) -> Values:
    """G = d_ff_ref / d_expert with d_ff_ref = ffn_ratio * d_model; 1 for dense models."""
    d_expert = np.asarray(arch.d_expert)
    ratio = np.asarray(arch.ffn_ratio) * arch.d_model / np.maximum(d_expert, 1)
    return np.where((np.asarray(arch.n_experts) > 0) & (d_expert > 0), ratio, 1.0)


def attention_flops_per_token(arch: ArchLike, layers: Any = None, causal: bool = True) -> Values:
    """Score and value matmuls, forward + backward, as the kernels execute them: causal attention
    skips the masked half, 6*L*s*h_q (`causal=False`: the whole square, 12*L*s*h_q, the PaLM /
    Megatron count, Chowdhery et al. 2022 app. B). MLA (query/key heads of head_dim, value heads
    of v_head_dim): 3*L*s*H*(head_dim + v_head_dim) causal, twice that without. `layers`
    defaults to n_layers."""
    half = 0.5 if causal else 1.0
    layers = np.asarray(arch.n_layers) if layers is None else layers
    mha = half * 12.0 * layers * arch.seq_len * np.asarray(arch.n_heads) * arch.head_dim
    on = uses_mla(arch)
    if not np.any(on):
        return mha
    mla = half * 6.0 * layers * arch.seq_len * np.asarray(arch.n_heads) * (np.asarray(arch.head_dim) + arch.v_head_dim)
    return np.where(on, mla, mha)


def mtp_flops_per_token(arch: ArchLike, causal: bool = True) -> Values:
    """Model FLOPs of the multi-token prediction modules (Megatron's convention): 6 x their active
    parameters, their LM-head logits 6*h*V each, their attention (`attention_flops_per_token`)."""
    n_mtp = np.asarray(arch.n_mtp_layers)
    if not np.any(n_mtp > 0):
        return np.zeros(np.shape(n_mtp)) if np.ndim(n_mtp) else 0.0
    lm_head = 6.0 * np.asarray(arch.d_model) * arch.vocab_size
    return np.where(n_mtp > 0, 6.0 * mtp_params(arch, active=True) + n_mtp * lm_head
                    + attention_flops_per_token(arch, n_mtp, causal), 0.0)


def model_flops_per_token(arch: ArchLike) -> Values:
    """Training model FLOPs per token, MOSAIC's convention (DESIGN.md): the MFU numerator.

    6*N_act (non-embedding) + 6*h*V (LM head) + 6*L*s*h_q (causal attention as executed; MLA:
    `attention_flops_per_token`) + the MTP modules (`mtp_flops_per_token`), so MFU cannot pass
    1 at long context. Recompute is not counted: this is the MFU numerator.
    """
    lm_head = 6.0 * np.asarray(arch.d_model) * arch.vocab_size
    return 6.0 * active_params(arch) + lm_head + attention_flops_per_token(arch) + mtp_flops_per_token(arch)


def model_flops_per_token_palm(arch: ArchLike) -> Values:
    """The PaLM / Megatron convention: as `model_flops_per_token` with the attention square not
    halved (12*L*s*h_q); reported beside MOSAIC's MFU as `mfu_palm` for comparison with published MFUs."""
    lm_head = 6.0 * np.asarray(arch.d_model) * arch.vocab_size
    return (6.0 * active_params(arch) + lm_head + attention_flops_per_token(arch, causal=False)
            + mtp_flops_per_token(arch, causal=False))
