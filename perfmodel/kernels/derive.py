"""Which measured rows stand for which accelerator, and the stated rules for what none measured.

- `TABLE_ACCELERATOR`: the table key (`accelerator` column) of each bundled cluster's device.
- `GENERATION`: accelerators whose GEMM tiles and waves are the same silicon generation share
  their fitted GEMM shape halves (`fit.fit_gemm_family`): Hopper GH100 (H100, H200, H800: 132
  SMs, the same die), Blackwell (B200, B300, GB200, GB300), Ampere, CDNA3, Ascend Da Vinci, cpu.
- `HALVES_FAMILY`: precisions whose GEMMs run the same kernel family share shape halves: the
  16/32-bit GEMMs (cuBLAS / hipBLASLt / CANN matmul) and the 8-bit ones (block-scaled FP8
  kernels such as DeepGEMM or TE's, whose tiles and scale loads differ): H100's bf16 cuBLAS
  reaches 80% of peak at n = 1024-2048 where DeepGEMM's FP8 rows halve at n ~ 1300.
- `HALVES_PER_PRECISION`: generations whose halves are fitted per precision (a CPU's engines).
- `NEAREST`: where an accelerator has no measured row of a kind (or precision, phase), its
  figure is the first listed accelerator's that has one, with the achieved rate scaled by the
  stated factor (a measured ratio where one exists, else 1 for the same silicon) - marked
  derived, with the rule, in the cluster file and `mosaic show-cluster`.
- `PRECISION_FALLBACK`: a precision without rows of its own on a measured accelerator takes the
  figure of the listed precision (same tensor-core path), marked derived.
- `SPAN_NEAREST`: a fabric level without measured collectives takes the efficiencies and step
  latency of the same span on the listed accelerator (same link generation), marked derived.
"""

from __future__ import annotations

TABLE_ACCELERATOR = {
    "a100_80gb": "a100", "h100": "h100", "h200": "h200", "h800": "h800", "b200": "b200", "b300": "b300",
    "gb200_nvl72": "gb200", "gb300_nvl72": "gb300", "mi300x": "mi300x", "ascend_910b": "ascend_910b",
    "ascend_superpod": "ascend_910c", "cpu_local": "cpu_local",
}

GENERATION = {
    "a100": "ampere", "h100": "hopper", "h200": "hopper", "h800": "hopper",
    "b200": "blackwell", "b300": "blackwell", "gb200": "blackwell", "gb300": "blackwell",
    "mi300x": "cdna3", "ascend_910b": "davinci", "ascend_910c": "davinci", "cpu_local": "cpu",
}

HALVES_FAMILY = {"fp32": "wide", "bf16": "wide", "fp16": "wide", "fp8": "fp8", "mxfp8": "fp8"}

HALVES_PER_PRECISION = {"cpu"}
"""Generations whose GEMM shape halves are fitted per precision: a CPU runs fp32 on its FMA
units and bf16 on other engines (AMX tiles, AVX-512 BF16 dot products), whose efficiency
saturates at other sizes (on the test machine, one core: fp32 halves about 30-45, bf16 about
300); one set of halves for both put the fp32 fit 28% off over the trainer's GEMM shapes against
9% with its own (`mosaic calibrate --quick` grid, 2026-12-01, docs/validation.md)."""


NEAREST: dict[str, tuple[tuple[str, float, str], ...]] = {
    "h200": (("h100", 1.0, "same GH100 die, 132 SMs, 700 W: MAMF bf16 equal, fp8 +3.6% (ml-engineering "
                           "MAMF table); H100's rate"),),
    "h800": (("h100", 1.0, "H100 silicon with fewer NVLink links: the same SMs and clocks; H100's rate"),),
    "h100": (("h800", 1.0, "H800 is H100 silicon (same SMs and clocks); H800's rate"),
             ("h200", 1.0, "same GH100 die; H200's rate")),
    "gb200": (("b200", 1.05, "B200 silicon at 1200 W: measured MAMF GB200/B200 = 1822/1745 bf16, "
                             "3616/3433 fp8 (+4.4%, +5.3%, ml-engineering); B200's rate x 1.05"),
              ("gb300", 1.0, "GB300's rate (same NVL72 tray and power class)")),
    "b200": (("b300", 1.0, "B300 = B200 for bf16/fp8: MAMF 1769 vs 1745 bf16, 3353 vs 3433 fp8 "
                           "(ml-engineering); B300's rate"),
             ("gb200", 1.0 / 1.05, "GB200 / 1.05 (measured MAMF ratio)"),
             ("gb300", 1.0 / 1.05, "GB300 / 1.05 (the measured GB200/B200 MAMF ratio; B300 = B200)")),
    "b300": (("b200", 1.0, "B300 = B200 for bf16/fp8: MAMF 1769 vs 1745 bf16, 3353 vs 3433 fp8 "
                           "(ml-engineering); B200's rate"),
             ("gb300", 1.0 / 1.05, "GB300 / 1.05 (the GB200/B200 MAMF ratio)")),
    "gb300": (("b300", 1.05, "no GB300 GEMM measurement: B300 x 1.05, the measured GB200/B200 MAMF ratio "
                             "(the same power step)"),
              ("gb200", 1.0, "GB200's rate (same NVL72 tray, Blackwell)")),
    "a100": (("h100", 312.0 / 989.0, "no A100 measurement of this kind: H100's fraction of peak at A100's "
                                      "peak (H100 rate x 312/989)"),),
    "mi300x": (("h100", 1300.0 / 989.0, "no MI300X measurement of this kind: H100's fraction of peak at "
                                         "MI300X's peak"),),
    "ascend_910c": (("ascend_910b", 376.0 / 354.0, "a 910C die is the 910B's Da Vinci core generation: "
                                                    "910B's fraction of peak at the die's 376 TFLOP/s"),
                    ("h100", 376.0 / 989.0, "no Ascend measurement of this kind: H100's fraction of peak")),
    "ascend_910b": (("h100", 354.0 / 989.0, "no Ascend measurement of this kind: H100's fraction of peak at "
                                             "910B's 354 TFLOP/s"),),
    "cpu_local": (),
}

PRECISION_FALLBACK = {
    "fp16": ("bf16", "the same tensor-core rate as bf16 (datasheet)"),
    "bf16": ("fp16", "the same tensor-core rate as fp16 (datasheet)"),
    "mxfp8": ("fp8", "the fp8 tensor-core path with block scales (datasheet: same peak)"),
    "fp8": ("bf16", "no fp8 rows: bf16's fraction of peak"),
    "fp32": ("bf16", "fp32 GEMMs are not used to train on this part: bf16's fraction of peak"),
}

SPAN_NEAREST: dict[tuple[str, str], tuple[str, str, str]] = {
    ("h800", "node"): ("h100", "node", "no H800 sweep: H100's NVLink4 efficiencies and step latency (the "
                                        "same link generation; H800 has 8 links, the datasheet bandwidth)"),
    ("h800", "scale_out"): ("h100", "scale_out", "no H800 multi-node sweep: H100's (400G CX-7 per GPU)"),
    ("h200", "scale_out"): ("h100", "scale_out", "H200 nodes use the same 400G CX-7 per GPU as H100"),
    ("b300", "node"): ("b200", "node", "B300 has B200's NVLink5 switch tray"),
    ("gb200", "scale_up"): ("gb200", "node", "NVL72 trays join the same NVLink5 switch"),
    ("gb300", "node"): ("gb200", "node", "GB300 trays are GB200's NVLink5 trays"),
    ("gb300", "scale_up"): ("gb200", "scale_up", "GB300 NVL72 uses GB200's NVLink5 spine"),
    ("a100", "scale_out"): ("b200", "scale_out", "no A100 sweep on a 200 Gb/s HDR port per GPU: the measured "
                                                  "efficiencies of ConnectX-class RDMA NICs (B200 nodes, 400G) at "
                                                  "the datasheet's 25 GB/s"),
    ("ascend_910c", "node"): ("ascend_910b", "node", "no 910C HCCL sweep: the 910B HCCS node's measured "
                                                     "efficiencies (Da Vinci HCCS generation)"),
    ("ascend_910c", "scale_up"): ("ascend_910b", "node", "no CloudMatrix384 UB sweep: the 910B HCCS node's "
                                                         "efficiencies (UB is a non-blocking Clos at the same "
                                                         "per-die bandwidth, CM384)"),
    ("ascend_910b", "scale_out"): ("h100", "scale_out", "no 910B RoCE sweep: H100's 400G RDMA NIC efficiencies"),
    ("ascend_910b", "node"): ("h100", "node", "the 910B HCCS node measured only peak busbw (limulidae): H100's "
                                              "step latency"),
    ("mi300x", "scale_out"): ("mi300x", "scale_out", ""),
}

COLLECTIVE_FALLBACK = {
    "all_gather": ("reduce_scatter", "all_gather moves the bytes reduce_scatter moves (ring (n-1)/n)"),
    "reduce_scatter": ("all_gather", "reduce_scatter moves the bytes all_gather moves (ring (n-1)/n)"),
    "p2p": ("all_gather", "no send/recv sweep: the ring collectives' link efficiency"),
    "all_to_all": ("all_gather", "no all_to_all sweep: the ring collectives' link efficiency"),
    "all_reduce": ("all_gather", "no all_reduce sweep: the ring collectives' link efficiency"),
}
"""A collective not measured on a level whose others were: the listed one's efficiency there."""


def span_of_level(index: int, name: str, n_levels: int) -> str:
    """node (innermost), scale_up (an NVLink/UB domain beyond the node: nvl72, supernode) or
    scale_out (the NIC network)."""
    if index == 0:
        return "node"
    if name in ("nvl72", "supernode", "scale_up"):
        return "scale_up"
    return "scale_out"
