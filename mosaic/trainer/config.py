"""What one training run is: `TrainOptions` + `RunConfig`, read and checked without torch.

`mosaic train` builds a `RunConfig` from a plan (or a model file and a layout
string), checks it here BEFORE any process starts (`check_runnable`: the
shared validity rules of perfmodel plus what this trainer can run), writes it
as ``DIR/run.yaml`` and hands that file to every rank
(``python -m mosaic.trainer.train DIR/run.yaml``). Calibration reads the same
file (`mosaic calibrate --from-runs`): resolved model, layout, cluster name,
device, world size, versions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from perfmodel import validity
from perfmodel.errors import InputError
from perfmodel.specs.architecture import MoEArchitecture
from perfmodel.specs.layout import ParallelLayout
from perfmodel.specs.strict import check, from_mapping, read_yaml, to_mapping

RUN_VERSION = 1
DEVICES = ("cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

Router = Literal["softmax", "sigmoid"]
ExpertsImpl = Literal["grouped", "loop"]


@dataclass(frozen=True)
class TrainOptions:
    """Knobs of the training loop that are not part of the model or the layout."""

    steps: int = 100
    """Optimizer steps to run (in total, counting steps done before a resume)."""
    seed: int = 0
    """Seeds the weights and the synthetic data; equal seeds give equal runs for any layout."""
    lr: float = 3.0e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 0
    """Linear warm-up steps, then cosine decay to 10% of lr at `steps`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms and biases)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    router: Router = "softmax"
    """softmax top-k with the Switch/GShard auxiliary loss, or sigmoid with DeepSeek-V3 bias balancing."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (softmax router; Switch Transformer uses 0.01)."""
    bias_update_rate: float = 1.0e-3
    """gamma of the sigmoid router's bias update (DeepSeek-V3 uses 0.001)."""
    experts: ExpertsImpl = "grouped"
    """grouped: one grouped GEMM over tokens sorted by expert; loop: the readable reference."""
    data: str = "synthetic"
    """'synthetic' (seeded Markov tokens) or a token file NAME.bin with its NAME.idx.npz index."""
    checkpoint: bool = True
    """Save checkpoints (every `checkpoint_every` steps and at the end); False saves none: a
    throughput run of a model of billions of parameters would otherwise write its weights and
    optimizer state (16 bytes a parameter) at its end."""
    val_data: str = ""
    """Held-out token file NAME.bin for the validation loss ('' = none; `mosaic data prepare` writes val.bin)."""
    eval_every: int = 0
    """Validation every N steps (0: at the last step only); needs val_data."""
    eval_batches: int = 0
    """Micro-batches of mbs sequences per data-parallel rank per validation (0: the whole file, every chunk once)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end of the run)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in DIR/checkpoints."""
    progress: bool = True
    """Rich progress display on rank 0."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}", "give a positive step count")
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}", "use e.g. 3e-4")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0", "give 0 or a positive count")
        check(self.weight_decay >= 0 and self.grad_clip >= 0, "weight_decay", "must be >= 0", "give 0 or a positive value")
        check(self.aux_loss_coef >= 0 and self.bias_update_rate >= 0, "aux_loss_coef", "must be >= 0", "give 0 or a positive value")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0", "give 0 (end only) or a step interval")
        check(self.checkpoint or self.checkpoint_every == 0, "checkpoint_every",
              f"{self.checkpoint_every} asks for checkpoints that checkpoint=false (--no-checkpoint) turns off",
              "drop one of them")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1", "keep at least one checkpoint")
        check(self.eval_every >= 0 and self.eval_batches >= 0, "eval_every", "must be >= 0",
              "give 0 (at the end / the whole file) or a positive count")
        check(bool(self.val_data) or self.eval_every == 0, "eval_every", "needs val_data",
              "give --val-data NAME.bin (e.g. the val.bin of `mosaic data prepare`)")


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs: the content of DIR/run.yaml."""

    model: MoEArchitecture
    layout: ParallelLayout
    """Resolved (dp and gbs filled)."""
    cluster: str
    """Cluster name or file: the source of the device peak for MFU."""
    device: str
    """cpu, cuda or npu."""
    world_size: int
    precision: str
    """The precision the trainer actually computes in (cpu: always fp32)."""
    out_dir: str
    train: TrainOptions = field(default_factory=TrainOptions)
    versions: dict[str, str] = field(default_factory=dict)
    """mosaic, torch, python (and torch_npu) versions of the run."""

    @property
    def backend(self) -> str:
        return BACKENDS[self.device]

    def to_dict(self) -> dict[str, Any]:
        return {"version": RUN_VERSION, **to_mapping(self)}


def trainer_precision(layout: ParallelLayout, device: str) -> str:
    """The precision the trainer computes in: fp32 on cpu; fp32, bf16 autocast or fp8 (torchao) on cuda/npu.

    fp16 layouts train in bf16 autocast (no loss scaling in the bundled trainer). fp8 needs
    cuda, torchao (Float8Linear, tensorwise scaling) and a GPU with fp8 tensor cores (compute
    capability 8.9 or newer: checked on the rank, `precision.check_fp8_device`); mxfp8 is refused.
    """
    if layout.precision == "mxfp8":
        raise InputError("layout: precision=mxfp8 is not implemented in the bundled trainer (torchao MX training "
                         "needs Blackwell GPUs); use precision=fp8 on cuda or precision=bf16")
    if layout.precision == "fp8":
        if device != "cuda":
            raise InputError(f"layout: precision=fp8 needs a cuda GPU with fp8 tensor cores and torchao; on {device} "
                             f"the trainer {'computes in fp32' if device == 'cpu' else 'has no fp8 kernels'}: use "
                             f"precision={'fp32' if device == 'cpu' else 'bf16'}")
        if not _has_module("torchao"):
            raise InputError("layout: precision=fp8 trains through torchao, which is not installed; "
                             "pip install torchao, or use precision=bf16")
        if layout.tp > 1:
            raise InputError("layout: precision=fp8 with tp > 1 is not wired (torchao's float8 tensor-parallel "
                             "styles); use tp=1 with fp8 or precision=bf16 with tensor parallel")
        return "fp8"
    if device == "cpu":
        return "fp32"
    return "fp32" if layout.precision == "fp32" else "bf16"


TRAINER_RECOMPUTE_MODULES = {False: ("core_attn", "op"), True: ("core_attn", "core_attn+mla_up_proj", "op")}
"""The selective recompute module sets the bundled trainer implements, without / with MLA."""


def unsupported_features(model: MoEArchitecture, layout: ParallelLayout) -> list[str]:
    """Model and layout features the bundled trainer does not implement (one message each): MTP,
    MLA with tensor parallel, the allgather / fused dispatchers, capacity factors, selective
    recompute modules beyond TRAINER_RECOMPUTE_MODULES."""
    problems = []
    if model.n_mtp_layers > 0:
        problems.append(f"n_mtp_layers={model.n_mtp_layers}: multi-token prediction is not implemented in the bundled "
                        "trainer; set n_mtp_layers: 0, or export the plan (mosaic export --format megatron)")
    if model.kv_lora_rank > 0 and layout.tp > 1:
        problems.append(f"kv_lora_rank={model.kv_lora_rank} (multi-head latent attention) with tp={layout.tp}: the "
                        "bundled trainer's tensor parallel covers standard attention only; use tp=1")
    if layout.dispatcher != "alltoall":
        problems.append(f"dispatcher={layout.dispatcher}: the bundled trainer dispatches tokens with all_to_all_single; "
                        "set dispatcher=alltoall")
    if layout.capacity_factor is not None:
        problems.append(f"capacity_factor={layout.capacity_factor:g}: the bundled trainer routes dropless; "
                        "leave capacity_factor out")
    supported = TRAINER_RECOMPUTE_MODULES[model.kv_lora_rank > 0]
    if layout.recompute == "selective" and (layout.recompute_modules or "core_attn") not in supported:
        problems.append(f"recompute_modules={layout.recompute_modules}: the bundled trainer's selective recompute "
                        f"checkpoints {' or '.join(supported)}; set recompute_modules to one of those, or export "
                        "the plan (mosaic export --format megatron)")
    return problems



def trainer_limits(model: MoEArchitecture, layout: ParallelLayout) -> list[str]:
    """What this trainer cannot run, beyond the shared validity rules (one message per reason)."""
    problems = unsupported_features(model, layout)
    if layout.cp > 1:
        problems.append(f"cp={layout.cp}: context parallel is not implemented in the bundled trainer; use cp=1")
    if layout.tp > 1:
        if model.seq_len % layout.tp:
            problems.append(f"tp={layout.tp} must divide seq_len={model.seq_len} (MoE layers and sequence parallel "
                            "split each sequence over the tp ranks); pick a divisor")
        if model.tie_embeddings:
            problems.append("tie_embeddings=true with tp > 1: tied embeddings are not split by the bundled "
                            "trainer's tensor parallel; untie them or use tp=1")
    if layout.tp == 1 and layout.sequence_parallel:
        problems.append("sequence_parallel=true needs tp > 1; set it to false")
    if layout.pp > 1:
        m = layout.micro_batches()
        if model.tie_embeddings:
            problems.append("tie_embeddings=true with pp > 1: the embedding (first stage) and the LM head (last "
                            "stage) would share a weight across stages; untie them or use pp=1")
        if m < layout.pp:
            problems.append(f"pp={layout.pp} needs at least pp micro-batches per step, got gbs/(mbs*dp)={m}; "
                            "raise gbs or lower mbs")
        elif layout.vpp > 1 and m % max(1, m // layout.pp):
            problems.append(f"vpp={layout.vpp}: interleaved 1F1B needs the micro-batches m={m} to be a multiple "
                            f"of m // pp = {m // layout.pp}; use m a multiple of pp={layout.pp}")
    if (layout.dp or 1) > 1 and layout.dp_flavor == "ddp" and (layout.tp > 1 or layout.pp > 1) \
            and not _has_module(REPLICATE_MODULE):
        problems.append(f"dp_flavor=ddp with tp or pp > 1 runs through FSDP2's replicate ({REPLICATE_MODULE}), "
                        "which this torch lacks (torch 2.6 has none); use dp_flavor=zero1 or fsdp, or a newer torch")
    return problems


def eval_limits(train: TrainOptions, layout: ParallelLayout) -> list[str]:
    """What the trainer's validation cannot run (one message per reason)."""
    problems = []
    if train.val_data and layout.pp > 1:
        problems.append(f"val_data with pp={layout.pp}: validation runs the model outside the pipeline schedule, "
                        "which the bundled trainer does not do; validate with pp=1 or drop --val-data")
    return problems


REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"
"""FSDP2's DDP (`parallelize.apply_dp` uses it under tensor or pipeline parallel); not in torch 2.6."""


def _has_module(name: str) -> bool:
    """`name` is importable (False as well where torch itself is missing: the trainer then says so)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def check_runnable(model: MoEArchitecture, layout: ParallelLayout, devices: int) -> ParallelLayout:
    """Every reason this (model, layout, devices) cannot run, as one InputError; else the resolved layout.

    Uses the shared validity rules (`perfmodel.validity.violations`) and adds what the
    bundled trainer cannot run (`trainer_limits`).
    """
    resolved = layout.resolve(devices) if layout.dp is None or layout.gbs is None else layout
    problems = validity.violations(model, resolved, devices)
    if not problems:
        problems = trainer_limits(model, resolved)
    if problems:
        raise InputError("layout cannot run: " + "; ".join(problems))
    return resolved


def model_from_mapping(data: Any, source: str) -> MoEArchitecture:
    if not isinstance(data, Mapping):
        raise InputError(f"{source}: key 'model' must be a mapping of MoEArchitecture keys")
    try:
        return from_mapping(MoEArchitecture, data)
    except InputError as exc:
        raise InputError(f"{source}: model: {exc}") from None


def _check_version(data: Mapping[str, Any], source: str) -> None:
    if "version" not in data:
        raise InputError(f"{source}: missing key 'version'; add 'version: {RUN_VERSION}' at the top")
    if data["version"] != RUN_VERSION:
        raise InputError(f"{source}: key 'version': {data['version']!r} is not supported; this MOSAIC reads version {RUN_VERSION}")


def load_model_file(path: str | Path) -> MoEArchitecture:
    """A model YAML: `version: 1` plus the MoEArchitecture keys (or a `model:` mapping)."""
    source = str(path)
    data = read_yaml(path)
    _check_version(data, source)
    body = {k: v for k, v in data.items() if k != "version"}
    if set(body) == {"model"}:
        body = body["model"]
    return model_from_mapping(body, source)


def load_run_config(path: str | Path) -> RunConfig:
    """Read DIR/run.yaml strictly (what every rank does first)."""
    source = str(path)
    data = dict(read_yaml(path))
    _check_version(data, source)
    data.pop("version")
    try:
        return from_mapping(RunConfig, data)
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def same_run(a: RunConfig, b: RunConfig) -> list[str]:
    """Fields that must not change across a resume and did."""
    changed = [name for name in ("model", "layout", "world_size", "device", "precision") if getattr(a, name) != getattr(b, name)]
    for name in ("seed", "router", "data", "experts"):
        if getattr(a.train, name) != getattr(b.train, name):
            changed.append(f"train.{name}")
    return changed


def replace_train(config: RunConfig, **changes: Any) -> RunConfig:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **changes))
