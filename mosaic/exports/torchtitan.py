"""torchtitan job TOML for a plan (torchtitan v0.2.2, the last release configured by TOML).

Matched against pytorch/torchtitan tag v0.2.2 (commit 73a0e6979dd1, 2026-02-20):
`torchtitan/config/job_config.py` (the JobConfig dataclasses: every section.key
written here is one of its fields; the list is stored with provenance in
tests/mosaic/exports/upstream_options.py), `torchtitan/distributed/parallel_dims.py`
(ep folds into dp_shard*cp*tp; etp must be 1 or tp), `torchtitan/distributed/
pipeline_parallel.py` (layers per virtual stage, microbatches = local_batch_size /
pipeline_parallel_microbatch_size), `torchtitan/train.py` (gradient accumulation
= global_batch_size / (local_batch_size * dp)), the model converters registered in
`torchtitan/components/quantization/{float8,mx}.py`, and the Qwen3 model
(`torchtitan/models/qwen3`: GQA with head_dim, RMSNorm, RoPE, SwiGLU, MoE with
shared experts of width moe_inter_dim * num_shared_experts). torchtitan main after
v0.2.2 configures runs in Python (`--module/--config`); its frozen
`--section.option` flags keep the same names as these TOML keys.

torchtitan takes the model geometry from a registered train spec, not from the
TOML, so the file's header carries a small Python module that registers
torchtitan's Qwen3 train spec with the plan's `Qwen3ModelArgs(...)` (and
torchtitan's `pipeline_llm`, which v0.2.2's qwen3 spec lacks); the TOML names
it in [model] and loads it through [experimental] custom_import. Where torchtitan's Qwen3 cannot express the plan
(dense first layers, a non-gated MLP, tp without sequence parallel), the header
says so in a WARNING line and `mosaic export` repeats it on stderr. A plan with multi-head latent
attention registers torchtitan's DeepSeek-V3 train spec instead (`DeepSeekV3ModelArgs`:
torchtitan/models/deepseek_v3/model/args.py at v0.2.2; MLA ranks and head dims, dense first
layers, routed + shared experts); MTP modules, the allgather/hybridep dispatchers and capacity
factors have no torchtitan equivalent (WARNING lines); dispatcher deepep sets
parallelism.expert_parallel_comm_backend = "deepep".

Pipeline: the even split as pipeline_parallel_layers_per_stage; stages of unequal depth (any of
the layout's split options, `perfmodel.specs.stages`) as parallelism.module_fqns_per_model_part,
torchtitan's explicit list of every model part's modules.

Layout mapping:
  fsdp    data_parallel_shard_degree = dp
  zero1   data_parallel_shard_degree = dp, fsdp_reshard_after_forward = "never" (parameters stay
          gathered from forward to backward; gradients and optimizer states sharded: ZeRO-2-like,
          the nearest FSDP2 policy to Megatron's distributed optimizer)
  ddp     data_parallel_replicate_degree = dp; with ep > 1 torchtitan needs FSDP on the expert
          ranks, so the smallest shard degree that holds ep is used (HSDP) and the header says so
  recompute selective -> mode "selective" with selective_ac_option "op" (per-op policy: every other
          matmul output saved, the rest recomputed): exact for recompute_modules=op, which the
          performance model prices as such; for Megatron's modules a stand-in (a WARNING line)
  overlap tp_comm_overlap -> parallelism.enable_async_tensor_parallel = true with compile.enable
          = true (async TP runs only compiled, job_config.py); overlap_grad_reduce /
          overlap_param_gather: FSDP2 prefetches the next gather and reduces behind the backward
          by itself (nothing to set; a plan with them off says so in a WARNING); ep_comm_overlap:
          refused (v0.2.2 overlaps expert-parallel communication only inside the DualPipeV
          pipeline schedule, `pipeline_parallel_expert_parallel_overlap`)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import yaml

from mosaic import frameworks
from mosaic.exports.common import header
from mosaic.planfile import Plan
from perfmodel.specs.stages import virtual_stage_layers
from perfmodel.specs.strict import to_mapping

TORCHTITAN_MATCHED = "pytorch/torchtitan tag v0.2.2 (73a0e6979dd1, 2026-02-20), torchtitan/config/job_config.py"
ROPE_THETA = 10000.0  # the bundled trainer's RoPE base (mosaic/trainer/model.py)


def flavor_name(plan: Plan) -> str:
    """Stable flavor name from the model geometry."""
    text = yaml.safe_dump(to_mapping(plan.model), sort_keys=True)
    return "mosaic_" + hashlib.sha256(text.encode()).hexdigest()[:10]


def qwen3_model_args(plan: Plan) -> dict[str, Any]:
    """Keyword arguments of torchtitan's Qwen3ModelArgs for the plan's model (MoEArgs as a dict)."""
    m = plan.model
    args: dict[str, Any] = {
        "vocab_size": m.vocab_size, "max_seq_len": m.seq_len, "dim": m.d_model, "n_layers": m.n_layers,
        "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "hidden_dim": m.d_ff_dense if m.d_ff_dense > 0 else m.d_expert,
        "qk_norm": False, "rope_theta": ROPE_THETA, "enable_weight_tying": m.tie_embeddings,
        "moe_enabled": m.n_experts > 0,
    }
    if m.n_experts > 0:
        args["moe_inter_dim"] = m.d_expert
        args["moe_args"] = {"num_experts": m.n_experts, "num_shared_experts": m.n_shared_experts,
                            "top_k": m.top_k, "score_func": "softmax", "route_norm": True}
    return args


def deepseek_v3_model_args(plan: Plan) -> dict[str, Any]:
    """Keyword arguments of torchtitan's DeepSeekV3ModelArgs (multi-head latent attention, dense first
    layers, routed + shared experts) for an MLA plan; original_seq_len = seq_len keeps YaRN off."""
    m = plan.model
    args: dict[str, Any] = {
        "vocab_size": m.vocab_size, "max_seq_len": m.seq_len, "original_seq_len": m.seq_len, "dim": m.d_model,
        "inter_dim": m.d_ff_dense if m.d_ff_dense > 0 else m.d_expert, "moe_inter_dim": m.d_expert,
        "n_layers": m.n_layers, "n_dense_layers": m.n_dense_layers if m.n_experts > 0 else m.n_layers,
        "n_heads": m.n_heads, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.head_dim - m.qk_rope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "rope_theta": ROPE_THETA,
    }
    if m.n_experts > 0:
        args["moe_args"] = {"num_experts": m.n_experts, "num_shared_experts": m.n_shared_experts,
                            "top_k": m.top_k, "score_func": "softmax", "route_norm": True}
    return args


def model_differences(plan: Plan) -> list[str]:
    """What torchtitan's model (Qwen3, or DeepSeek-V3 for multi-head latent attention) builds
    differently from the plan's model and layout."""
    m, lay = plan.model, plan.layout
    notes = []
    if m.n_experts > 0 and m.n_dense_layers > 0 and m.kv_lora_rank == 0:
        notes.append(f"torchtitan's Qwen3 has no dense first layers: its first {m.n_dense_layers} layer(s) "
                     "are MoE layers too")
    if not m.gated_ffn:
        notes.append("torchtitan's FFN is SwiGLU; the plan's model uses a plain (GeLU) MLP")
    if lay.tp > 1 and not lay.sequence_parallel:
        notes.append("torchtitan's tensor parallel always shards norms over the sequence (sequence parallel)")
    if not (lay.overlap_grad_reduce and (lay.overlap_param_gather or lay.dp_flavor == "ddp")):
        notes.append("torchtitan's FSDP2/DDP overlap the gradient reduce and parameter gather by themselves; "
                     "the plan priced them exposed (overlap_grad_reduce / overlap_param_gather off)")
    if m.kv_lora_rank > 0 and m.tie_embeddings:
        notes.append("torchtitan's DeepSeek-V3 does not tie the embeddings")
    if m.n_mtp_layers > 0:
        notes.append(f"torchtitan has no multi-token prediction: the plan's {m.n_mtp_layers} MTP module(s) are left out")
    if m.n_experts > 0 and lay.dispatcher in ("allgather", "hybridep"):
        notes.append(f"torchtitan has no {lay.dispatcher} dispatcher: the export uses its standard all-to-all")
    if m.n_experts > 0 and lay.capacity_factor is not None:
        notes.append("torchtitan routes dropless: the plan's capacity factor is left out")
    if lay.recompute == "selective" and lay.recompute_modules != "op":
        notes.append(f"torchtitan's selective checkpointing is per-op (selective_ac_option op); the plan priced "
                     f"Megatron's {lay.recompute_modules or 'core_attn'} (recompute_modules=op prices torchtitan's)")
    return notes


FLAVOR = "plan"
"""Flavor name inside the registered train spec (the spec itself is named by `flavor_name`)."""


def _python_call(name: str, kwargs: dict[str, Any], indent: str = "    ") -> list[str]:
    lines = [f"{name}("]
    for key, value in kwargs.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k}={v!r}" for k, v in value.items())
            lines.append(f"{indent}{key}=MoEArgs({inner}),")
        else:
            lines.append(f"{indent}{key}={value!r},")
    lines.append(")")
    return lines


def flavor_module(plan: Plan) -> str:
    """Python module registering a train spec for the plan's model (for [experimental] custom_import).

    torchtitan v0.2.2 takes geometry from registered model args; its qwen3 train spec has no
    pipelining function (pipelining_fn=None) although the Qwen3 model passes through missing
    stages, so the spec registered here adds torchtitan's `pipeline_llm`.
    """
    if plan.model.kv_lora_rank > 0:
        call = _python_call("DeepSeekV3ModelArgs", deepseek_v3_model_args(plan), indent="        ")
        model_import = "from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, get_train_spec"
    else:
        call = _python_call("Qwen3ModelArgs", qwen3_model_args(plan), indent="        ")
        model_import = "from torchtitan.models.qwen3 import Qwen3ModelArgs, get_train_spec"
    lines = [
        "import dataclasses",
        "",
        "from torchtitan.distributed.pipeline_parallel import pipeline_llm",
        "from torchtitan.models.moe import MoEArgs",
        model_import,
        "from torchtitan.protocols.train_spec import register_train_spec",
        "",
        "register_train_spec(",
        f"    {flavor_name(plan)!r},",
        "    dataclasses.replace(",
        "        get_train_spec(),",
        "        pipelining_fn=pipeline_llm,",
        f"        model_args={{{FLAVOR!r}: " + call[0],
        *[f"    {line}" for line in call[1:-1]],
        "        )},",
        "    ),",
        ")",
    ]
    return "\n".join(lines) + "\n"


def parallel_degrees(plan: Plan) -> dict[str, Any]:
    """The [parallelism] table (without pipeline keys)."""
    lay = plan.layout
    dp = int(lay.dp)
    replicate, shard = 1, dp
    if lay.dp_flavor == "ddp":
        shard = next(k for k in range(1, dp + 1)
                     if dp % k == 0 and (k * lay.cp * lay.tp) % (lay.etp * lay.ep) == 0)
        replicate = dp // shard
    table: dict[str, Any] = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    if lay.dp_flavor == "zero1":
        table["fsdp_reshard_after_forward"] = "never"
    table.update({"tensor_parallel_degree": lay.tp, "context_parallel_degree": lay.cp,
                  "expert_parallel_degree": lay.ep, "expert_tensor_parallel_degree": lay.etp if lay.ep > 1 else 1})
    return table


def job_tables(plan: Plan) -> dict[str, dict[str, Any]]:
    """The TOML as nested tables (section -> key -> value)."""
    lay, m = plan.layout, plan.model
    frameworks.check("torchtitan", lay, plan.source)
    dp = int(lay.dp)
    tables: dict[str, dict[str, Any]] = {
        "job": {"dump_folder": "./outputs", "description": f"MOSAIC plan {plan.source}"},
        "model": {"name": flavor_name(plan), "flavor": FLAVOR},
        "training": {},
        "parallelism": parallel_degrees(plan),
        "activation_checkpoint": {},
        "experimental": {"custom_import": flavor_name(plan)},
    }
    training = tables["training"]
    if lay.pp > 1:
        training["local_batch_size"] = int(lay.gbs) // dp  # all m micro-batches go through the pipeline
    else:
        training["local_batch_size"] = lay.mbs  # torchtitan accumulates gbs / (mbs * dp) steps
    training.update({"global_batch_size": int(lay.gbs), "seq_len": m.seq_len, "steps": plan.train_iters,
                     "mixed_precision_param": "float32" if lay.precision == "fp32" else "bfloat16",
                     "dataset": "c4"})
    if lay.pp > 1:
        tables["parallelism"].update({
            "pipeline_parallel_degree": lay.pp,
            "pipeline_parallel_schedule": "Interleaved1F1B" if lay.vpp > 1 else "1F1B",
        })
        counts = virtual_stage_layers(m.n_layers, lay)
        if len(set(counts)) == 1:  # the even split
            tables["parallelism"].update({
                "pipeline_parallel_layers_per_stage": counts[0],
                "pipeline_parallel_first_stage_less_layers": 0,  # layers split evenly, as the performance model does
                "pipeline_parallel_last_stage_less_layers": 0,
            })
        else:  # stages of unequal depth: every model part's modules, as the plan splits them
            tables["parallelism"]["module_fqns_per_model_part"] = module_fqns_per_model_part(counts)
        tables["parallelism"]["pipeline_parallel_microbatch_size"] = lay.mbs
    if m.n_experts > 0 and lay.dispatcher == "deepep":
        tables["parallelism"]["expert_parallel_comm_backend"] = "deepep"
    if lay.tp_comm_overlap:
        tables["parallelism"]["enable_async_tensor_parallel"] = True
        tables["compile"] = {"enable": True}
    checkpoint = tables["activation_checkpoint"]
    checkpoint["mode"] = lay.recompute
    if lay.recompute == "selective":
        checkpoint["selective_ac_option"] = "op"
    if lay.precision in ("fp8", "mxfp8"):
        kind = "float8" if lay.precision == "fp8" else "mx"
        converters = [f"quantize.linear.{kind}"]
        tables[f"quantize.linear.{kind}"] = {"filter_fqns": ["output", "router.gate"]}
        if lay.precision == "fp8":
            tables["quantize.linear.float8"]["recipe_name"] = "tensorwise"
        if m.n_experts > 0:
            converters.append(f"quantize.grouped_mm.{kind}")
            tables[f"quantize.grouped_mm.{kind}"] = {"fqns": ["experts"]}
        tables["model"]["converters"] = converters
    return tables


def module_fqns_per_model_part(counts: list[int] | tuple[int, ...]) -> list[list[str]]:
    """torchtitan's module names of each model part (virtual stage): the embedding on the first,
    `counts[j]` consecutive layers on part j, the final norm and the LM head on the last."""
    parts, layer = [], 0
    for j, count in enumerate(counts):
        names = ["tok_embeddings"] if j == 0 else []
        names += [f"layers.{i}" for i in range(layer, layer + count)]
        layer += count
        if j == len(counts) - 1:
            names += ["norm", "output"]
        parts.append(names)
    return parts


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"no TOML form for {value!r}")


def render_torchtitan(plan: Plan, gpus_per_node: Optional[int] = None) -> str:
    """The job TOML, with the flavor registration and any model differences in the header."""
    tables = job_tables(plan)
    lines = [header(plan, "torchtitan job config for a MOSAIC plan (run: ./run_train.sh "
                          "--job.config_file THIS.toml)", (TORCHTITAN_MATCHED,)).rstrip("\n")]
    for note in model_differences(plan):
        lines.append(f"# WARNING: {note}.")
    module = flavor_name(plan)
    lines.append(f"# torchtitan builds the model from a registered train spec: save the lines below (without '# ') "
                 f"as {module}.py on PYTHONPATH; [experimental] custom_import loads it.")
    lines += [f"#   {line}".rstrip() for line in flavor_module(plan).splitlines()]
    par = tables["parallelism"]
    if plan.layout.dp_flavor == "ddp" and par["data_parallel_shard_degree"] > 1:
        lines.append(f"# NOTE: ddp with ep={plan.layout.ep}: torchtitan shards the expert ranks with FSDP, so dp "
                     f"{plan.layout.dp} = {par['data_parallel_replicate_degree']} replicas x "
                     f"{par['data_parallel_shard_degree']} shards (HSDP).")
    lines.append(f"# Global batch {plan.layout.gbs} sequences = dp {plan.layout.dp} x {plan.micro_batches} "
                 f"micro-batches x {plan.layout.mbs}; steps = ceil(tokens / (gbs * seq_len)).")
    for section, table in tables.items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


__all__ = ["TORCHTITAN_MATCHED", "FLAVOR", "deepseek_v3_model_args", "flavor_module", "flavor_name", "job_tables",
           "model_differences", "module_fqns_per_model_part", "parallel_degrees", "qwen3_model_args", "render_torchtitan"]
