"""Option names the exporters may emit, as the upstream projects define them (test data).

Each table was taken from the project's own source at the version named here;
regenerate it from that source (not from our exporter) when moving to a newer
version. The exporter tests check every option an export contains against these
tables: name, arity (0 = flag, 1 = one value, '+' = one or more) and choices.

MEGATRON_OPTIONS: NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
  (2026-08-22; megatron/core/package_info.py 0.20.0). Built by calling
  megatron.training.arguments.add_megatron_arguments(argparse.ArgumentParser())
  (878 options; GPU-only imports such as triton stubbed) and reading each
  action's option_strings, nargs and choices. The same code's validate_args()
  accepted the example plan's full argv (world size 64, Hopper).
MEGATRON_CORE_0_12_1_OPTIONS: the same, at tag core_v0.12.1
  (a845aa7e12b3a117e24c2352b9e3e60bad2e3a17, 458 options), the Megatron that
  MindSpeed-LLM's install guide checks out (docs/en/pytorch/training/install_guide.md).
MINDSPEED_OPTIONS: add_argument calls in Ascend/MindSpeed commit
  028de58ca629d035185b00ff7d1eb7eff4f7fd48 (2026-07-21) and Ascend/MindSpeed-LLM
  commit c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91 (2026-08-21), file named per option.
TORCHTITAN_JOB_KEYS: pytorch/torchtitan tag v0.2.2 (73a0e6979dd1, 2026-02-20),
  torchtitan/config/job_config.py: every field of the JobConfig dataclass tree
  (sections used by the exporter), walked with dataclasses.fields.
QWEN3_MODEL_ARGS / DEEPSEEK_V3_MODEL_ARGS / MOE_ARGS: fields of Qwen3ModelArgs
  (torchtitan/models/qwen3/model/args.py), DeepSeekV3ModelArgs (torchtitan/models/deepseek_v3/model/args.py)
  and MoEArgs (torchtitan/models/moe/moe.py) at v0.2.2.
TORCHTITAN_CONVERTERS: register_model_converter names in
  torchtitan/components/quantization/{float8,mx}.py at v0.2.2.
PIPELINE_SCHEDULES: names accepted by torch.distributed.pipelining.schedules.get_schedule_class
  (torch 2.13), which torchtitan's pipeline_parallel_schedule is passed to.
SBATCH_OPTIONS / SRUN_OPTIONS: SchedMD/slurm commit 284c3b95f08a (2026-08-20, Slurm 26.11.0),
  doc/man/man1/sbatch.1 and srun.1 option headings.
TORCHRUN_OPTIONS: torch.distributed.run.get_args_parser() of torch 2.13.
"""

MEGATRON_OPTIONS = {
    # overlap switches: add_argument in arguments.py (--overlap-grad-reduce, --overlap-param-gather)
    # and ModelParallelConfig bool fields turned into store_true flags by ArgumentGroupFactory
    # (arguments.py `ArgumentGroupFactory(TransformerConfig)`; tp_comm_overlap,
    # overlap_moe_expert_parallel_comm in megatron/core/model_parallel_config.py)
    '--overlap-grad-reduce': (0, None),
    '--overlap-param-gather': (0, None),
    '--tp-comm-overlap': (0, None),
    '--overlap-moe-expert-parallel-comm': (0, None),
    '--tensor-model-parallel-size': (1, None),
    '--pipeline-model-parallel-size': (1, None),
    '--num-layers-per-virtual-pipeline-stage': (1, None),
    '--context-parallel-size': (1, None),
    '--expert-model-parallel-size': (1, None),
    '--expert-tensor-parallel-size': (1, None),
    '--sequence-parallel': (0, None),
    '--use-distributed-optimizer': (0, None),
    '--use-megatron-fsdp': (0, None),
    '--data-parallel-sharding-strategy': (1, ('no_shard', 'optim', 'optim_grads', 'optim_grads_params')),
    '--ckpt-format': (1, ('torch', 'torch_dist', 'torch_dcp', 'fsdp_dtensor')),
    '--num-experts': (1, None),
    '--moe-router-topk': (1, None),
    '--moe-ffn-hidden-size': (1, None),
    '--moe-shared-expert-intermediate-size': (1, None),
    '--moe-layer-freq': (1, None),
    '--moe-grouped-gemm': (0, None),
    '--moe-token-dispatcher-type': (1, ('allgather', 'alltoall', 'flex')),
    '--num-layers': (1, None),
    '--hidden-size': (1, None),
    '--ffn-hidden-size': (1, None),
    '--num-attention-heads': (1, None),
    '--group-query-attention': (0, None),
    '--num-query-groups': (1, None),
    '--kv-channels': (1, None),
    '--seq-length': (1, None),
    '--max-position-embeddings': (1, None),
    '--swiglu': (0, None),
    '--untie-embeddings-and-output-weights': (0, None),
    '--normalization': (1, ('LayerNorm', 'RMSNorm')),
    '--position-embedding-type': (1, ('learned_absolute', 'rope', 'yarn', 'mrope', 'relative', 'none')),
    '--disable-bias-linear': (0, None),
    '--recompute-granularity': (1, ('full', 'selective')),
    '--recompute-method': (1, ('uniform', 'block')),
    '--recompute-num-layers': (1, None),
    '--recompute-modules': ('+', None),
    '--bf16': (0, None),
    '--fp16': (0, None),
    '--fp8-format': (1, ('e4m3', 'hybrid')),
    '--fp8-recipe': (1, ('tensorwise', 'delayed', 'mxfp8', 'blockwise', 'custom')),
    '--micro-batch-size': (1, None),
    '--global-batch-size': (1, None),
    '--train-iters': (1, None),
    '--lr': (1, None),
    '--min-lr': (1, None),
    '--lr-decay-style': (1, ('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD')),
    '--weight-decay': (1, None),
    '--adam-beta1': (1, None),
    '--adam-beta2': (1, None),
    '--clip-grad': (1, None),
    '--data-path': ('+', None),
    '--tokenizer-type': (1, ('BertWordPieceLowerCase', 'BertWordPieceCase', 'GPT2BPETokenizer', 'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'HuggingFaceTokenizer', 'Llama2Tokenizer', 'TikTokenizer', 'MultimodalTokenizer', 'NullTokenizer', 'NullMultimodalTokenizer', 'SFTTokenizer')),
    '--tokenizer-model': (1, None),
    '--split': (1, None),
    '--mock-data': (0, None),
    '--vocab-size': (1, None),
    '--save': (1, None),
    '--load': (1, None),
    '--save-interval': (1, None),
    '--log-interval': (1, None),
    '--eval-interval': (1, None),
    '--eval-iters': (1, None),
    '--use-mcore-models': (0, None),
    '--transformer-impl': (1, ('local', 'transformer_engine', 'inference_optimized')),
    '--use-flash-attn': (0, None),
    '--no-gradient-accumulation-fusion': (0, None),
    '--distributed-backend': (1, ('nccl', 'gloo')),
    '--make-vocab-size-divisible-by': (1, None),
    # pipeline split, MLA, MTP, dispatchers and capacity (issue 19), read from the same parser build
    '--decoder-first-pipeline-num-layers': (1, None),
    '--decoder-last-pipeline-num-layers': (1, None),
    '--account-for-embedding-in-pipeline-split': (0, None),
    '--account-for-loss-in-pipeline-split': (0, None),
    '--pipeline-model-parallel-layout': (1, None),
    '--num-virtual-stages-per-pipeline-rank': (1, None),
    '--multi-latent-attention': (0, None),
    '--q-lora-rank': (1, None),
    '--kv-lora-rank': (1, None),
    '--qk-head-dim': (1, None),
    '--qk-pos-emb-head-dim': (1, None),
    '--v-head-dim': (1, None),
    '--mtp-num-layers': (1, None),
    '--moe-expert-capacity-factor': (1, None),
    '--moe-pad-expert-input-to-capacity': (0, None),
    '--moe-flex-dispatcher-backend': (1, ('deepep', 'hybridep', 'ncclep')),
}

MEGATRON_CORE_0_12_1_OPTIONS = {
    '--overlap-grad-reduce': (0, None),  # arguments.py add_argument at core_v0.12.1
    '--overlap-param-gather': (0, None),  # (validate_args: needs --overlap-grad-reduce)
    '--tensor-model-parallel-size': (1, None),
    '--pipeline-model-parallel-size': (1, None),
    '--num-layers-per-virtual-pipeline-stage': (1, None),
    '--context-parallel-size': (1, None),
    '--expert-model-parallel-size': (1, None),
    '--expert-tensor-parallel-size': (1, None),
    '--sequence-parallel': (0, None),
    '--use-distributed-optimizer': (0, None),
    '--data-parallel-sharding-strategy': (1, ('no_shard', 'optim', 'optim_grads', 'optim_grads_params')),
    '--ckpt-format': (1, ('torch', 'torch_dist', 'zarr', 'torch_dcp')),
    '--use-custom-fsdp': (0, None),
    '--num-experts': (1, None),
    '--moe-router-topk': (1, None),
    '--moe-ffn-hidden-size': (1, None),
    '--moe-shared-expert-intermediate-size': (1, None),
    '--moe-layer-freq': (1, None),
    '--moe-grouped-gemm': (0, None),
    '--moe-token-dispatcher-type': (1, ('allgather', 'alltoall', 'flex', 'alltoall_seq')),
    '--num-layers': (1, None),
    '--hidden-size': (1, None),
    '--ffn-hidden-size': (1, None),
    '--num-attention-heads': (1, None),
    '--group-query-attention': (0, None),
    '--num-query-groups': (1, None),
    '--kv-channels': (1, None),
    '--seq-length': (1, None),
    '--max-position-embeddings': (1, None),
    '--swiglu': (0, None),
    '--untie-embeddings-and-output-weights': (0, None),
    '--normalization': (1, ('LayerNorm', 'RMSNorm')),
    '--position-embedding-type': (1, ('learned_absolute', 'rope', 'mrope', 'relative', 'none')),
    '--disable-bias-linear': (0, None),
    '--recompute-granularity': (1, ('full', 'selective')),
    '--recompute-method': (1, ('uniform', 'block')),
    '--recompute-num-layers': (1, None),
    '--recompute-modules': ('+', None),
    '--bf16': (0, None),
    '--fp16': (0, None),
    '--fp8-format': (1, ('e4m3', 'hybrid')),
    '--fp8-recipe': (1, ('tensorwise', 'delayed', 'mxfp8')),
    '--micro-batch-size': (1, None),
    '--global-batch-size': (1, None),
    '--train-iters': (1, None),
    '--lr': (1, None),
    '--min-lr': (1, None),
    '--lr-decay-style': (1, ('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD')),
    '--weight-decay': (1, None),
    '--adam-beta1': (1, None),
    '--adam-beta2': (1, None),
    '--clip-grad': (1, None),
    '--data-path': ('+', None),
    '--tokenizer-type': (1, ('BertWordPieceLowerCase', 'BertWordPieceCase', 'GPT2BPETokenizer', 'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'HuggingFaceTokenizer', 'Llama2Tokenizer', 'TikTokenizer', 'MultimodalTokenizer', 'NullTokenizer', 'NullMultimodalTokenizer')),
    '--tokenizer-model': (1, None),
    '--split': (1, None),
    '--mock-data': (0, None),
    '--vocab-size': (1, None),
    '--save': (1, None),
    '--load': (1, None),
    '--save-interval': (1, None),
    '--log-interval': (1, None),
    '--eval-interval': (1, None),
    '--eval-iters': (1, None),
    '--use-mcore-models': (0, None),
    '--transformer-impl': (1, ('local', 'transformer_engine')),
    '--use-flash-attn': (0, None),
    '--no-gradient-accumulation-fusion': (0, None),
    '--distributed-backend': (1, ('nccl', 'gloo')),
    '--make-vocab-size-divisible-by': (1, None),
    # pipeline split, MLA, MTP and capacity (issue 19), read from the same parser build; this tag
    # has no --pipeline-model-parallel-layout
    '--decoder-first-pipeline-num-layers': (1, None),
    '--decoder-last-pipeline-num-layers': (1, None),
    '--account-for-embedding-in-pipeline-split': (0, None),
    '--account-for-loss-in-pipeline-split': (0, None),
    '--num-virtual-stages-per-pipeline-rank': (1, None),
    '--multi-latent-attention': (0, None),
    '--q-lora-rank': (1, None),
    '--kv-lora-rank': (1, None),
    '--qk-head-dim': (1, None),
    '--qk-pos-emb-head-dim': (1, None),
    '--v-head-dim': (1, None),
    '--mtp-num-layers': (1, None),
    '--moe-expert-capacity-factor': (1, None),
    '--moe-pad-expert-input-to-capacity': (0, None),
}

TORCHTITAN_JOB_KEYS = {
    'compile.enable': 'bool',
    'job.config_file': 'str | None',
    'job.dump_folder': 'str',
    'job.description': 'str',
    'job.print_config': 'bool',
    'job.save_config_file': 'str | None',
    'job.custom_config_module': 'str',
    'model.name': 'str',
    'model.flavor': 'str',
    'model.hf_assets_path': 'str',
    'model.tokenizer_path': 'str | None',
    'model.converters': 'list[str]',
    'model.print_after_conversion': 'bool',
    'training.dataset': 'str',
    'training.dataset_path': 'str | None',
    'training.local_batch_size': 'int',
    'training.global_batch_size': 'int',
    'training.seq_len': 'int',
    'training.max_norm': 'float | int',
    'training.steps': 'int',
    'training.enable_cpu_offload': 'bool',
    'training.dtype': "typing.Literal['bfloat16', 'float32']",
    'training.mixed_precision_param': "typing.Literal['bfloat16', 'float32']",
    'training.mixed_precision_reduce': "typing.Literal['float32']",
    'training.gc_freq': 'int',
    'training.gc_debug': 'bool',
    'training.dataloader.num_workers': 'int',
    'training.dataloader.persistent_workers': 'bool',
    'training.dataloader.pin_memory': 'bool',
    'training.dataloader.prefetch_factor': 'int | None',
    'parallelism.data_parallel_replicate_degree': 'int',
    'parallelism.data_parallel_shard_degree': 'int',
    'parallelism.fsdp_reshard_after_forward': "typing.Literal['default', 'always', 'never']",
    'parallelism.tensor_parallel_degree': 'int',
    'parallelism.disable_loss_parallel': 'bool',
    'parallelism.enable_async_tensor_parallel': 'bool',
    'parallelism.pipeline_parallel_degree': 'int',
    'parallelism.module_fqns_per_model_part': 'list[list[str]] | None',
    'parallelism.pipeline_parallel_first_stage_less_layers': 'int',
    'parallelism.pipeline_parallel_last_stage_less_layers': 'int',
    'parallelism.pipeline_parallel_layers_per_stage': 'int | None',
    'parallelism.pipeline_parallel_schedule': 'str',
    'parallelism.pipeline_parallel_schedule_csv': 'str | None',
    'parallelism.pipeline_parallel_microbatch_size': 'int',
    'parallelism.pipeline_parallel_expert_parallel_overlap': 'bool',
    'parallelism.context_parallel_degree': 'int',
    'parallelism.context_parallel_load_balancer': 'str | None',
    'parallelism.context_parallel_rotate_method': "typing.Literal['allgather', 'alltoall']",
    'parallelism.expert_parallel_degree': 'int',
    'parallelism.expert_tensor_parallel_degree': 'int',
    'parallelism.expert_parallel_comm_backend': "typing.Literal['standard', 'deepep']",
    'activation_checkpoint.mode': "typing.Literal['selective', 'full', 'memory_budget', 'none']",
    'activation_checkpoint.selective_ac_option': 'str',
    'activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns': 'list[str]',
    'activation_checkpoint.early_stop': 'bool',
    'activation_checkpoint.memory_budget': 'float',
    'activation_checkpoint.visualize_memory_budget_pareto': 'bool',
    'activation_checkpoint.preserve_rng_state': 'bool',
    'activation_checkpoint.determinism_check': 'str',
    'activation_checkpoint.debug': 'bool',
    'quantize.linear.float8.enable_fsdp_float8_all_gather': 'bool',
    'quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp': 'bool',
    'quantize.linear.float8.recipe_name': "typing.Optional[typing.Literal['tensorwise', 'rowwise', 'rowwise_with_gw_hp']]",
    'quantize.linear.float8.filter_fqns': 'list[str]',
    'quantize.linear.float8.emulate': 'bool',
    'quantize.linear.mx.mxfp8_dim1_cast_kernel_choice': "typing.Literal['triton', 'cuda', 'torch']",
    'quantize.linear.mx.recipe_name': 'str',
    'quantize.linear.mx.filter_fqns': 'list[str]',
    'quantize.grouped_mm.float8.fqns': 'list[str] | str',
    'quantize.grouped_mm.mx.recipe_name': "typing.Literal['mxfp8']",
    'quantize.grouped_mm.mx.fqns': 'list[str] | str',
    'experimental.custom_import': 'str',
    'experimental.custom_args_module': 'str',
}

# Ascend/MindSpeed (M) and Ascend/MindSpeed-LLM (L) options beyond Megatron core_v0.12.1.
MINDSPEED_OPTIONS = {
    "--use-fused-rmsnorm": (0, None),  # M mindspeed/features_manager/megatron_basic/megatron_basic.py
    "--use-fused-swiglu": (0, None),  # M mindspeed/features_manager/megatron_basic/megatron_basic.py
    "--use-fused-rotary-pos-emb": (0, None),  # M mindspeed/features_manager/fusions/fused_rope.py
    "--moe-alltoall-overlap-comm": (0, None),  # M mindspeed/features_manager/moe/moe_alltoall_overlap.py
    "--use-ascend-coc": (0, None),  # M mindspeed/features_manager/tensor_parallel/locl_coc.py
    "--first-k-dense-replace": (1, None),  # L mindspeed_llm/features_manager/transformer/transformer_block.py
    "--tokenizer-name-or-path": (1, None),  # L mindspeed_llm/features_manager/tokenizer/build_tokenizer.py
    "--padded-vocab-size": (1, None),  # L mindspeed_llm/features_manager/tokenizer/build_tokenizer.py
    "--num-layer-list": (1, None),  # L mindspeed_llm/features_manager/pipeline_parallel/num_layer_list.py
}
# Choices MindSpeed-LLM adds to Megatron options (add_parser_argument_choices_value in build_tokenizer.py).
MINDSPEED_EXTRA_CHOICES = {"--tokenizer-type": ("PretrainedFromHF",)}

QWEN3_MODEL_ARGS = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim", "hidden_dim", "norm_eps", "rope_theta",
    "qk_norm", "max_seq_len", "depth_init", "attn_type", "attn_mask_type", "eos_id", "enable_weight_tying",
    "moe_enabled", "moe_inter_dim", "moe_args",
)
DEEPSEEK_V3_MODEL_ARGS = (  # torchtitan/models/deepseek_v3/model/args.py at v0.2.2 (DeepSeekV3ModelArgs fields)
    "max_batch_size", "max_seq_len", "vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers",
    "n_heads", "norm_eps", "moe_args", "expert_parallel_comm_backend", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attn_type", "attn_mask_type", "original_seq_len",
    "rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale",
)
MOE_ARGS = (
    "num_experts", "num_shared_experts", "score_func", "route_norm", "route_scale", "gate_bias",
    "score_before_experts", "top_k", "num_expert_groups", "num_limited_groups", "use_grouped_mm",
    "load_balance_coeff",
)
TORCHTITAN_CONVERTERS = (
    "quantize.linear.float8", "quantize.grouped_mm.float8", "quantize.linear.mx", "quantize.grouped_mm.mx",
)
TORCHTITAN_CHOICES = {
    "activation_checkpoint.mode": ("selective", "full", "memory_budget", "none"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "training.mixed_precision_param": ("bfloat16", "float32"),
    "quantize.linear.float8.recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
}
PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")

SBATCH_OPTIONS = ("--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--exclusive", "--output")
SRUN_OPTIONS = ("--ntasks-per-node", "--kill-on-bad-exit")
TORCHRUN_OPTIONS = ("--nnodes", "--nproc_per_node", "--node_rank", "--master_addr", "--master_port", "--rdzv_id",
                    "--rdzv_backend", "--rdzv_endpoint", "-m")
