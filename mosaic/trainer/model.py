"""The bundled model: a decoder-only MoE transformer, single-device code only.

Built from `MoEArchitecture`: RMSNorm, RoPE, GQA attention through SDPA (or multi-head latent
attention, `LatentAttention`, when kv_lora_rank > 0),
gated (SwiGLU) or plain MLP for the dense layers, and MoE layers with a
top-k router (softmax + Switch/GShard auxiliary loss, or sigmoid with
DeepSeek-V3 bias balancing), shared experts and `n_dense_layers` dense first
layers. Parallelism is applied from outside (`parallelize.py`); the expert
computation is its own module (`GroupedExperts`) so that expert parallel can
replace it with a dispatch -> local experts -> combine version.

Shapes in names: B batch, T sequence, H d_model, N = B*T tokens, K = top_k,
E experts, F expert width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from perfmodel.specs.architecture import MoEArchitecture

ROPE_THETA = 10000.0  # RoFormer (Su et al. 2021) / Llama default base


def rope(x_BTnD: torch.Tensor, positions_BT: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form, as in Llama/GPT-NeoX)."""
    head_dim = x_BTnD.shape[-1]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=x_BTnD.device, dtype=torch.float32) / head_dim))
    angles = positions_BT.to(torch.float32)[..., None] * inv_freq  # (B|1, T, D/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, :, None, :].to(x_BTnD.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, :, None, :].to(x_BTnD.dtype)
    half1, half2 = x_BTnD.chunk(2, dim=-1)
    rotated = torch.cat([-half2, half1], dim=-1)
    return x_BTnD * cos + rotated * sin


def document_causal_mask(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean mask: causal and within the same document (packed sequences)."""
    T = doc_ids_BT.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids_BT.device).tril()
    same_doc = doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]
    return (same_doc & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, arch: MoEArchitecture):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = arch.n_heads, arch.n_kv_heads, arch.head_dim
        self.wq = nn.Linear(arch.d_model, arch.n_heads * arch.head_dim, bias=False)
        self.wk = nn.Linear(arch.d_model, arch.n_kv_heads * arch.head_dim, bias=False)
        self.wv = nn.Linear(arch.d_model, arch.n_kv_heads * arch.head_dim, bias=False)
        self.wo = nn.Linear(arch.n_heads * arch.head_dim, arch.d_model, bias=False)
        self.checkpoint_core = False
        """Selective recompute: recompute the attention core (SDPA) in backward."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:  # GQA: each kv head serves `repeat` query heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, x_BTH: torch.Tensor, positions_BT: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        # -1: the heads of this rank (all of them on one device, n_heads/tp under tensor parallel)
        q = rope(self.wq(x_BTH).view(B, T, -1, self.head_dim), positions_BT).transpose(1, 2)
        k = rope(self.wk(x_BTH).view(B, T, -1, self.head_dim), positions_BT).transpose(1, 2)
        v = self.wv(x_BTH).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.checkpoint_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(self.core, q, k, v, mask, use_reentrant=False)
        else:
            out = self.core(q, k, v, mask)  # (B, n_heads, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 sec. 2.1; the performance model's
    `mla_attention_ops`). Queries: q_lora_rank > 0 compresses h to r_q (wq_a), normalises the
    latent and expands it to H heads of d_q = head_dim (wq_b); else one projection (wq). Keys and
    values: h -> r_kv latent + one shared rotary key of d_r (wkv_a), the latent normalised and
    expanded to H non-rotary keys of d_q - d_r and H values of d_v (wkv_b). RoPE (rotate-half, as
    `Attention`) on the rotary parts; a head's key is [non-rotary key, the shared rotary key].
    Selective recompute: `checkpoint_core` recomputes the attention core (Megatron's core_attn:
    Q, K, V stay stored); with `checkpoint_up` as well, the up projections and RoPE with it
    (core_attn + mla_up_proj): only the latents are kept."""

    def __init__(self, arch: MoEArchitecture):
        super().__init__()
        h, H = arch.d_model, arch.n_heads
        self.n_heads, self.d_q, self.d_r, self.d_v = H, arch.head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.d_n = arch.head_dim - arch.qk_rope_head_dim
        self.r_q, self.r_kv = arch.q_lora_rank, arch.kv_lora_rank
        if self.r_q > 0:
            self.wq_a = nn.Linear(h, self.r_q, bias=False)
            self.q_norm = nn.RMSNorm(self.r_q, eps=1e-6)
            self.wq_b = nn.Linear(self.r_q, H * self.d_q, bias=False)
        else:
            self.wq = nn.Linear(h, H * self.d_q, bias=False)
        self.wkv_a = nn.Linear(h, self.r_kv + self.d_r, bias=False)
        self.kv_norm = nn.RMSNorm(self.r_kv, eps=1e-6)
        self.wkv_b = nn.Linear(self.r_kv, H * (self.d_n + self.d_v), bias=False)
        self.wo = nn.Linear(H * self.d_v, h, bias=False)
        self.checkpoint_core = False
        self.checkpoint_up = False

    def up_and_core(self, q_lat_BTR: torch.Tensor, kv_lat_BTR: torch.Tensor, k_rope_BTD: torch.Tensor,
                    positions_BT: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Up projections, RoPE and the attention core: (B, T, H * d_v)."""
        return self.core(*self.up(q_lat_BTR, kv_lat_BTR, k_rope_BTD, positions_BT), mask)

    def up(self, q_lat_BTR: torch.Tensor, kv_lat_BTR: torch.Tensor, k_rope_BTD: torch.Tensor,
           positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up projections and RoPE: Q, K, V as (B, H, T, d)."""
        B, T, _ = q_lat_BTR.shape
        H = self.n_heads
        q = (self.wq_b(self.q_norm(q_lat_BTR)) if self.r_q > 0 else self.wq(q_lat_BTR)).view(B, T, H, self.d_q)
        q = torch.cat([q[..., :self.d_n], rope(q[..., self.d_n:], positions_BT)], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_lat_BTR)).view(B, T, H, self.d_n + self.d_v)
        k_rope = rope(k_rope_BTD.view(B, T, 1, self.d_r), positions_BT).expand(B, T, H, self.d_r)
        k = torch.cat([kv[..., :self.d_n], k_rope], dim=-1)
        v = kv[..., self.d_n:]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        return q, k, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention core on (B, H, T, d) heads: (B, T, H * d_v)."""
        B, _, T, _ = q.shape
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(B, T, self.n_heads * self.d_v)

    def forward(self, x_BTH: torch.Tensor, positions_BT: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        q_lat = self.wq_a(x_BTH) if self.r_q > 0 else x_BTH
        kv_lat, k_rope = self.wkv_a(x_BTH).split([self.r_kv, self.d_r], dim=-1)
        if self.checkpoint_up and self.checkpoint_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(self.up_and_core, q_lat, kv_lat, k_rope, positions_BT, mask,
                                                    use_reentrant=False)
        elif self.checkpoint_core and torch.is_grad_enabled():
            q, k, v = self.up(q_lat, kv_lat, k_rope, positions_BT)
            out = torch.utils.checkpoint.checkpoint(self.core, q, k, v, mask, use_reentrant=False)
        else:
            out = self.up_and_core(q_lat, kv_lat, k_rope, positions_BT, mask)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x) (Shazeer 2020) or plain w2(gelu(w1 x))."""

    def __init__(self, d_model: int, hidden: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


def _grouped_mm_ok(dtype: Optional[torch.dtype], *tensors: torch.Tensor) -> bool:
    """torch's grouped GEMM exists and the inner strides are 16-byte aligned in the dtype it
    will run in (`dtype`, or each tensor's own when None): its requirement."""
    if not hasattr(F, "grouped_mm"):
        return False
    return all(t.shape[-1] * (dtype or t.dtype).itemsize % 16 == 0 for t in tensors)


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The lower-precision dtype autocast gives a matmul on x's device, None where autocast is off."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class GroupedExperts(nn.Module):
    """E routed experts as stacked weights; input rows are sorted by expert.

    `forward(x_NH, counts_E)`: rows [0, counts[0]) go to expert 0, the next
    counts[1] rows to expert 1, ... Two implementations, tested equal: one
    grouped GEMM per matrix (`torch.nn.functional.grouped_mm`) and a
    for-loop over experts (the reference; also the fallback when grouped_mm
    is absent or the widths are not 16-byte aligned).
    """

    def __init__(self, n_experts: int, d_model: int, d_expert: int, gated: bool, impl: str = "grouped"):
        super().__init__()
        self.n_experts, self.gated, self.impl = n_experts, gated, impl
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_expert)) if gated else None

    def _act(self, h1: torch.Tensor, h3: Optional[torch.Tensor]) -> torch.Tensor:
        return F.silu(h1) * h3 if h3 is not None else F.gelu(h1)

    def forward_loop(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        outputs = []
        # NOTE: host-device sync (counts to Python ints).
        for e, x_e in enumerate(torch.split(x_NH, counts_E.tolist(), dim=0)):
            h3 = x_e @ self.w3[e] if self.w3 is not None else None
            outputs.append(self._act(x_e @ self.w1[e], h3) @ self.w2[e])
        return torch.cat(outputs, dim=0)

    def forward_grouped(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per matrix. Operands are cast to the autocast dtype where autocast is
        on, as it would cast a matmul: torch's grouped GEMM is not registered with autocast
        (pytorch/pytorch#174763), and without the cast the routed experts of a bf16-autocast
        run compute in fp32."""
        offsets = torch.cumsum(counts_E, dim=0).to(torch.int32)  # group ends, (E,)
        dtype = autocast_dtype(x_NH)
        x, w1, w2 = (t if dtype is None else t.to(dtype) for t in (x_NH, self.w1, self.w2))
        w3 = self.w3 if dtype is None or self.w3 is None else self.w3.to(dtype)
        h1 = F.grouped_mm(x, w1, offs=offsets)
        h3 = F.grouped_mm(x, w3, offs=offsets) if w3 is not None else None
        return F.grouped_mm(self._act(h1, h3), w2, offs=offsets)

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x_NH)
        if self.impl == "grouped" and x_NH.shape[0] > 0 and _grouped_mm_ok(dtype, self.w1, self.w2):
            return self.forward_grouped(x_NH, counts_E)
        if x_NH.shape[0] == 0:
            # Keep the autograd graph through x and the weights even without rows: under expert
            # parallel every rank must run the same backward all-to-alls, and send the dtype the
            # ranks with rows send (the autocast dtype where autocast is on).
            anchor = x_NH.sum() + sum(p.sum() for p in self.parameters(recurse=False))
            return (x_NH.new_zeros(0, self.w2.shape[-1]) + 0.0 * anchor).to(dtype or x_NH.dtype)
        return self.forward_loop(x_NH, counts_E)


class Router(nn.Module):
    """Top-k token-choice router.

    softmax: weights = softmax over the k chosen logits (Mixtral), auxiliary
    loss E * sum_i f_i * P_i (Switch Transformer, Fedus et al. 2021).
    sigmoid: scores = sigmoid(logits); experts chosen by score + bias, the bias
    nudged after each step towards equal load (DeepSeek-V3, aux-loss-free);
    weights = chosen scores normalised to sum 1.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, kind: str):
        super().__init__()
        self.n_experts, self.top_k, self.kind = n_experts, top_k, kind
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)
        self.sum_over_token_shards: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        """Set by tensor parallel, which splits a micro-batch's tokens over the tp ranks for the MoE
        layer: sums a per-rank statistic over those ranks (forward all-reduce, backward identity), so
        the auxiliary loss is the one of the whole micro-batch. None on one device."""

    def forward(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns weights (N, K), expert ids (N, K), aux loss (scalar), counts (E,)."""
        logits_NE = self.gate(x_NH).float()
        if self.kind == "sigmoid":
            scores_NE = torch.sigmoid(logits_NE)
            _, ids_NK = torch.topk(scores_NE + self.expert_bias, self.top_k, dim=-1)
            weights_NK = scores_NE.gather(-1, ids_NK)
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
            aux = logits_NE.new_zeros(())
        else:
            probs_NE = torch.softmax(logits_NE, dim=-1)
            top_logits, ids_NK = torch.topk(logits_NE, self.top_k, dim=-1)
            weights_NK = torch.softmax(top_logits, dim=-1)
            counts = torch.bincount(ids_NK.flatten(), minlength=self.n_experts).float()
            if self.sum_over_token_shards is None:
                fraction_E = counts / ids_NK.numel()
                mean_prob_E = probs_NE.mean(0)
            else:  # the statistics of the whole micro-batch from the tp ranks' token shards
                n = counts.new_tensor([float(x_NH.shape[0])])
                total = self.sum_over_token_shards(torch.cat([probs_NE.sum(0), counts, n]))
                E = self.n_experts
                n_all = total[2 * E]
                fraction_E = total[E:2 * E] / (n_all * self.top_k)
                mean_prob_E = total[:E] / n_all
            aux = self.n_experts * (fraction_E * mean_prob_E).sum()
        counts_E = torch.bincount(ids_NK.flatten(), minlength=self.n_experts)
        return weights_NK.to(x_NH.dtype), ids_NK, aux, counts_E


class MoE(nn.Module):
    """Routed experts (+ shared experts): sort tokens by expert, run experts, weight and sum back."""

    def __init__(self, arch: MoEArchitecture, router: str, experts_impl: str):
        super().__init__()
        self.top_k = arch.top_k
        self.router = Router(arch.d_model, arch.n_experts, arch.top_k, router)
        self.experts = GroupedExperts(arch.n_experts, arch.d_model, arch.d_expert, arch.gated_ffn, experts_impl)
        self.shared = (FeedForward(arch.d_model, arch.n_shared_experts * arch.d_expert, arch.gated_ffn)
                       if arch.n_shared_experts > 0 else None)
        self.load_E = torch.zeros(arch.n_experts, dtype=torch.long)
        """Tokens routed to each expert since the last `reset_load` (this rank; not a parameter)."""

    def reset_load(self) -> None:
        self.load_E = torch.zeros_like(self.load_E)

    def forward(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H = x_BTH.shape
        x_NH = x_BTH.reshape(B * T, H)
        weights_NK, ids_NK, aux, counts_E = self.router(x_NH)
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self.load_E = self.load_E.to(counts_E.device) + counts_E.detach()
        order = torch.argsort(ids_NK.flatten(), stable=True)  # (N*K,) sorted by expert
        token_of = order // self.top_k
        y_sorted = self.experts(x_NH[token_of], counts_E)  # (N*K, H)
        y_sorted = y_sorted * weights_NK.flatten()[order, None]
        out_NH = torch.zeros_like(x_NH).index_add(0, token_of, y_sorted)
        if self.shared is not None:
            out_NH = out_NH + self.shared(x_NH)
        return out_NH.view(B, T, H), aux


class Block(nn.Module):
    def __init__(self, arch: MoEArchitecture, layer: int, router: str, experts_impl: str):
        super().__init__()
        self.attn_norm = nn.RMSNorm(arch.d_model, eps=1e-6)
        self.attn: nn.Module = LatentAttention(arch) if arch.kv_lora_rank > 0 else Attention(arch)
        self.ffn_norm = nn.RMSNorm(arch.d_model, eps=1e-6)
        self.is_moe = arch.n_experts > 0 and layer >= arch.n_dense_layers
        self.ffn: nn.Module = (MoE(arch, router, experts_impl) if self.is_moe
                               else FeedForward(arch.d_model, arch.d_ff_dense, arch.gated_ffn))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        if self.is_moe:
            y, aux = self.ffn(self.ffn_norm(x))
        else:
            y, aux = self.ffn(self.ffn_norm(x)), x.new_zeros((), dtype=torch.float32)
        return x + y, aux


def _op_sac_saved() -> frozenset:
    """The ops whose outputs the per-op policy saves (besides every other aten.mm: `op_sac_context`)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max")
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)} | {aten.mm.default}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        saved.add(functional.reduce_scatter_tensor.default)
    return frozenset(saved)


def op_sac_context():
    """Selective activation checkpointing by op (torchtitan's `selective_ac_option = "op"` policy,
    as `perfmodel.operators.op_sac` prices it): within one block, save the outputs of aten.mm
    except every second one (a count per block and per pass), of SDPA, max and reduce-scatter;
    recompute everything else. A fresh count for each block's forward and its recompute."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved, mm = _op_sac_saved(), torch.ops.aten.mm.default
    counts = {True: 0, False: 0}

    def policy(ctx, func, *args, **kwargs):
        if func == mm:
            counts[ctx.is_recompute] += 1
        keep = func in saved and not (func == mm and counts[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Transformer(nn.Module):
    """Decoder-only LM; `forward(tokens, positions, doc_ids) -> (logits, aux_loss summed over MoE layers)`."""

    def __init__(self, arch: MoEArchitecture, router: str = "softmax", experts_impl: str = "grouped"):
        super().__init__()
        self.arch = arch
        self.tok_embeddings = nn.Embedding(arch.vocab_size, arch.d_model)
        # keyed by the layer index, so a pipeline chunk that keeps some layers keeps their names
        self.layers = nn.ModuleDict({str(i): Block(arch, i, router, experts_impl) for i in range(arch.n_layers)})
        self.norm = nn.RMSNorm(arch.d_model, eps=1e-6)
        self.output = nn.Linear(arch.d_model, arch.vocab_size, bias=False)
        if arch.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_blocks = False
        """Full recompute: each block's activations are recomputed in backward."""
        self.op_sac = False
        """torchtitan's per-op policy (`op_sac_context`) on each block."""
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) (GPT-2); output projections scaled by 1/sqrt(2L) (GPT-2/Megatron)."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.arch.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)  # RMSNorm weights
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers.values() if isinstance(b.ffn, MoE)]

    def forward(self, tokens_BT: torch.Tensor, positions_BT: Optional[torch.Tensor] = None,
                doc_ids_BT: Optional[torch.Tensor] = None,
                aux_in: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) tokens -> ((B, T, V) logits, aux loss summed over this model's MoE layers + aux_in).

        A pipeline chunk (see pipeline.py) is this model with some parts removed: without
        `tok_embeddings` its input is the (B, T, H) hidden state of the previous chunk, without
        `output` (and `norm`) it returns the hidden state instead of logits.
        """
        B, T = tokens_BT.shape[:2]
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device)[None].expand(B, T)
        mask = document_causal_mask(doc_ids_BT) if doc_ids_BT is not None else None
        x = self.tok_embeddings(tokens_BT) if self.tok_embeddings is not None else tokens_BT
        aux_total = aux_in if aux_in is not None else torch.zeros((), dtype=torch.float32, device=x.device)
        for block in self.layers.values():
            if self.op_sac and torch.is_grad_enabled():
                x, aux = torch.utils.checkpoint.checkpoint(block, x, positions_BT, mask, use_reentrant=False,
                                                           context_fn=op_sac_context)
            elif self.checkpoint_blocks and torch.is_grad_enabled():
                x, aux = torch.utils.checkpoint.checkpoint(block, x, positions_BT, mask, use_reentrant=False)
            else:
                x, aux = block(x, positions_BT, mask)
            aux_total = aux_total + aux
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x, aux_total
