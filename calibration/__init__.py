"""Microbenchmarks and collectives that calibrate the performance model (`mosaic calibrate`).

Modules (torch is imported only inside `timing`, `kernels` and the functions of
`collectives`/`run` that measure, so fitting, writing and `--from-runs` work
without it):

- `stats`        median with an interference-robust outlier filter, IQR/median noise
- `timing`       device selection (cpu, cuda, npu via torch_npu), the bundled cluster of this
                 machine's device, and device-side timing
- `kernels`      the kernels the forms of `perfmodel.kernels.forms` are fitted to: a factorial
                 GEMM grid, grouped expert GEMM fwd/dgrad/wgrad, causal SDPA fwd/bwd, memory-bound
                 kernel classes; launch latency
- `eager_ops`    what an eager op is (a dispatch-mode counter) and the host time of one op,
                 one DTensor op and one activation-checkpointed region (cpu clusters)
- `collectives`  all_reduce, all_gather, reduce_scatter, all_to_all, send/recv under torchrun,
                 and the subprocess launcher with hang/death detection
- `measurements` one timed point (`Measurement`), and the raw CSV the collective ranks append to
- `tables`       the measurements as kernel-table rows (`perfmodel/data/kernels` format) in the
                 folder beside the calibrated YAML, read back, bundled
- `fit`          alpha-beta fits (R^2, nccl-tests bus bandwidth); the forms' ceilings (cpu peaks)
- `profile`      the calibrated cluster YAML: the base's datasheet + the tables, built by
                 `perfmodel.kernels.build` as the bundled clusters are, + `calibration:`
- `report`       markdown report with PNG plots (measured against fitted, per kind)
- `run`          the end-to-end `calibrate(...)` behind the CLI
- `from_runs`    correction factors fitted to the bundled trainer's step times
- `drift`        a calibrated cluster re-fitted to probes taken between runs, or merged from a
                 calibration before and one after them (a shared machine's speed drifts)

Imports point down: perfmodel (and torch) only; what it needs of the bundled trainer (its
op counts) lives beside the trainer, `mosaic.trainer.op_count`.
"""
