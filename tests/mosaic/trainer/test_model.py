"""Single-device model: grouped experts == for-loop reference, routing, masking, recompute."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (extra 'train')")

from mosaic.trainer.model import GroupedExperts, MoE, Transformer  # noqa: E402
from mosaic.trainer.parallelize import _source_to_expert_major, apply_ac  # noqa: E402


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm (the loop runs)")
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_equal_loop_reference(gated):
    torch.manual_seed(0)
    experts = GroupedExperts(n_experts=4, d_model=16, d_expert=8, gated=gated)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts = torch.tensor([5, 0, 7, 3])  # an expert without tokens too
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    grad_out = torch.randn(int(counts.sum()), 16)

    y_grouped = experts.forward_grouped(x, counts)
    y_grouped.backward(grad_out)
    grads_grouped = [x.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
    x.grad = None
    experts.zero_grad()
    y_loop = experts.forward_loop(x, counts)
    y_loop.backward(grad_out)
    grads_loop = [x.grad] + [p.grad for p in experts.parameters()]

    torch.testing.assert_close(y_grouped, y_loop, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_grouped, grads_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_compute_in_the_autocast_dtype_like_the_loop(gated):
    """torch's grouped GEMM is not registered with autocast (pytorch/pytorch#174763): under bf16
    autocast the grouped path must cast its operands as autocast casts the loop's matmuls, or
    the routed experts of a cuda bf16 run compute in fp32."""
    torch.manual_seed(1)
    experts = GroupedExperts(n_experts=4, d_model=16, d_expert=16, gated=gated)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)  # fp32 rows, as the MoE layer hands them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_grouped = experts(x, counts)
        y_loop = experts.forward_loop(x, counts)
        y_empty = experts(x[:0], counts * 0)
    assert y_grouped.dtype == y_loop.dtype == y_empty.dtype == torch.bfloat16
    torch.testing.assert_close(y_grouped.float(), y_loop.float(), rtol=2e-2, atol=2e-2)
    y_grouped.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32  # master weights and inputs keep their dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in experts.parameters())


def test_moe_layer_equals_per_token_sum(tiny_arch):
    """out(x) = sum over the chosen experts of weight * expert(x) + shared(x), token by token."""
    torch.manual_seed(1)
    moe = MoE(tiny_arch, router="softmax", experts_impl="grouped")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, tiny_arch.d_model)
    out, _ = moe(x)
    flat = x.reshape(-1, tiny_arch.d_model)
    weights, ids, _, _ = moe.router(flat)
    e = moe.experts
    for n in range(flat.shape[0]):
        expected = moe.shared(flat[n:n + 1])[0]
        for k in range(tiny_arch.top_k):
            i = int(ids[n, k])
            h = torch.nn.functional.silu(flat[n] @ e.w1[i]) * (flat[n] @ e.w3[i])
            expected = expected + weights[n, k] * (h @ e.w2[i])
        torch.testing.assert_close(out.reshape(-1, tiny_arch.d_model)[n], expected, rtol=1e-5, atol=1e-6)


def test_softmax_router_aux_loss_is_one_when_balanced(tiny_arch):
    moe = MoE(tiny_arch, router="softmax", experts_impl="grouped")
    torch.nn.init.zeros_(moe.router.gate.weight)  # uniform probabilities
    weights, ids, aux, counts = moe.router(torch.randn(8, tiny_arch.d_model))
    torch.testing.assert_close(weights.sum(-1), torch.ones(8))
    assert int(counts.sum()) == 8 * tiny_arch.top_k
    # E * sum_i f_i * P_i with P_i = 1/E is sum_i f_i = 1 whatever the choice
    assert float(aux.detach()) == pytest.approx(1.0, rel=1e-6)


def test_sigmoid_router_bias_steers_selection_not_weights(tiny_arch):
    moe = MoE(tiny_arch, router="sigmoid", experts_impl="grouped")
    x = torch.randn(16, tiny_arch.d_model)
    moe.router.expert_bias[2] = 100.0
    weights, ids, aux, counts = moe.router(x)
    assert (ids == 2).any(dim=-1).all()  # every token now picks expert 2
    assert float(aux.detach()) == 0.0
    torch.testing.assert_close(weights.sum(-1), torch.ones(16))
    scores = torch.sigmoid(moe.router.gate(x))
    chosen = scores.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))  # bias not in the weights


def test_packed_documents_do_not_see_each_other(tiny_arch):
    """A document packed behind another gives the logits it gives alone (mask + RoPE restart)."""
    torch.manual_seed(2)
    model = Transformer(tiny_arch).eval()
    doc_a = torch.randint(0, tiny_arch.vocab_size, (1, 6))
    doc_b = torch.randint(0, tiny_arch.vocab_size, (1, 10))
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10])
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with torch.no_grad():
        packed_logits, _ = model(packed, positions, doc_ids)
        alone_logits, _ = model(doc_b)
        unmasked_logits, _ = model(packed)
    torch.testing.assert_close(packed_logits[:, 6:], alone_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked_logits[:, 6:], alone_logits, atol=1e-3)


def _grads(model, tokens):
    model.zero_grad()
    logits, aux = model(tokens)
    (logits.square().mean() + aux).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode, modules", [("selective", None), ("selective", "op"), ("full", None)])
def test_recompute_gives_the_same_gradients(tiny_arch, mode, modules):
    torch.manual_seed(3)
    model = Transformer(tiny_arch)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, tiny_arch.seq_len))

    reference = _grads(model, tokens)
    for moe in model.moe_layers():
        moe.reset_load()
    apply_ac(model, mode, modules)
    recomputed = _grads(model, tokens)
    for a, b in zip(reference, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the expert load counts each forward once, not again when recomputed
    assert int(model.moe_layers()[0].load_E.sum()) == 2 * tiny_arch.seq_len * tiny_arch.top_k


def test_dispatch_regroups_rows_expert_major():
    counts_SE = torch.tensor([[2, 1], [0, 3], [1, 1]])  # 3 sources x 2 local experts
    rows = torch.arange(int(counts_SE.sum()))  # received order: source-major
    # source 0: e0 e0 e1 | source 1: e1 e1 e1 | source 2: e0 e1
    expert_of = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1])
    perm = _source_to_expert_major(counts_SE)
    assert sorted(perm.tolist()) == rows.tolist()
    assert expert_of[perm].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert perm.tolist() == [0, 1, 6, 2, 3, 4, 5, 7]  # stable: by source within an expert


def test_tied_embeddings_share_one_matrix(tiny_arch):
    model = Transformer(dataclasses.replace(tiny_arch, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_bf16_autocast_forward_backward_stays_close_to_fp32(tiny_arch):
    """The cuda/npu precision path (bf16 autocast) runs through grouped experts and routing."""
    torch.manual_seed(4)
    model = Transformer(tiny_arch)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, tiny_arch.seq_len))
    reference, _ = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, aux = model(tokens)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, rtol=0.05, atol=0.05)
    (logits.float().square().mean() + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def _plain_mla(attn, x, positions):
    """Multi-head latent attention written out with explicit matmuls (DeepSeek-V2 sec. 2.1 eqs.
    37-47): queries from the (normalised) latent or directly, keys = [W_UK c_kv, rope(W_KR h)],
    values W_UV c_kv, causal softmax(q k^T / sqrt(d_q)) v, then W_O."""
    from mosaic.trainer.model import rope

    B, T, _ = x.shape
    H, d_n, d_r, d_v = attn.n_heads, attn.d_n, attn.d_r, attn.d_v
    rms = lambda t, norm: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight  # noqa: E731
    if attn.r_q > 0:
        q = rms(x @ attn.wq_a.weight.T, attn.q_norm) @ attn.wq_b.weight.T
    else:
        q = x @ attn.wq.weight.T
    q = q.view(B, T, H, d_n + d_r)
    latent = x @ attn.wkv_a.weight.T
    c_kv, k_r = latent[..., :attn.r_kv], latent[..., attn.r_kv:]
    kv = (rms(c_kv, attn.kv_norm) @ attn.wkv_b.weight.T).view(B, T, H, d_n + d_v)
    k_r = rope(k_r.view(B, T, 1, d_r), positions)
    out = torch.zeros(B, T, H, d_v)
    for b in range(B):
        for head in range(H):
            qh = torch.cat([q[b, :, head, :d_n], rope(q[b:b + 1, :, head:head + 1, d_n:], positions[b:b + 1])[0, :, 0]], -1)
            kh = torch.cat([kv[b, :, head, :d_n], k_r[b, :, 0]], -1)
            scores = qh @ kh.T / (d_n + d_r) ** 0.5
            scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            out[b, :, head] = torch.softmax(scores, -1) @ kv[b, :, head, d_n:]
    return out.reshape(B, T, H * d_v) @ attn.wo.weight.T


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_latent_attention_equals_plain_reference(tiny_arch, q_lora_rank):
    from mosaic.trainer.model import LatentAttention

    arch = tiny_arch.replace(n_kv_heads=4, head_dim=12, kv_lora_rank=10, q_lora_rank=q_lora_rank,
                             qk_rope_head_dim=4, v_head_dim=6)
    torch.manual_seed(0)
    attn = LatentAttention(arch)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, arch.seq_len, arch.d_model)
    positions = torch.arange(arch.seq_len)[None].expand(2, -1)
    torch.testing.assert_close(attn(x, positions, None), _plain_mla(attn, x, positions), rtol=1e-5, atol=1e-6)
    # the model builds it for an MLA architecture; selective recompute gives the same gradients
    model = Transformer(arch)
    assert all(isinstance(b.attn, LatentAttention) for b in model.layers.values())
    tokens = torch.randint(0, arch.vocab_size, (2, arch.seq_len))

    reference = _grads(model, tokens)
    for modules in (None, "core_attn+mla_up_proj"):  # the core alone, and with the up projections
        apply_ac(model, "selective", modules)
        assert all(b.attn.checkpoint_up == (modules is not None) for b in model.layers.values())
        for a, b in zip(reference, _grads(model, tokens)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    expected = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.attn."))
    from perfmodel.specs.architecture import attention_params_per_layer
    assert expected == int(attention_params_per_layer(arch))  # the perf model counts the module's parameters


def test_the_op_policy_recomputes_every_other_block_matmul(tiny_arch):
    """aten.mm calls over a forward and backward pass: the op policy repeats the even-numbered
    matmuls of each block, full recompute all of them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func == torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(3)
    model = Transformer(tiny_arch)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, tiny_arch.seq_len))

    def mm_calls(mode, modules=None, blocks_only=False):
        apply_ac(model, mode, modules)
        counter = CountMM()
        with counter:
            if blocks_only:  # the forward matmuls of each block alone
                x = model.tok_embeddings(tokens)
                positions = torch.arange(tiny_arch.seq_len)[None].expand(2, -1)
                per_block = []
                for block in model.layers.values():
                    before = counter.mm
                    x, _ = block(x, positions, None)
                    per_block.append(counter.mm - before)
                return per_block
            logits, aux = model(tokens)
            (logits.square().mean() + aux).backward()
        return counter.mm

    per_block = mm_calls("none", blocks_only=True)
    none, op, full = mm_calls("none"), mm_calls("selective", "op"), mm_calls("full")
    # even-numbered matmuls again, but not a block's last (its output feeds only additions: the
    # checkpoint's early stop; perfmodel.operators.OP_SAC_TRAILING)
    assert op - none == sum(n // 2 - (n % 2 == 0) for n in per_block), (per_block, none, op)
    assert op - none < full - none <= sum(per_block)  # full: every matmul but those the early stop skips
