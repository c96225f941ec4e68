"""A candidate's prediction does not depend on the batch it is evaluated in.

The vectorised path takes different formula branches for a batch that mixes kinds of
candidates (standard and latent attention, dispatchers, MTP): each row must come out exactly
as when it is evaluated alone (a batch of one takes the plain branches)."""

from __future__ import annotations

from perfmodel import evaluate, load_cluster
from perfmodel.specs import ArchBatch, LayoutBatch, MoEArchitecture, parse_layout
from perfmodel.specs.strict import load_spec

CLUSTER = load_cluster("h100")
LATENT = load_spec(MoEArchitecture, "examples/models/deepseek_v3.yaml").replace(n_layers=8, n_dense_layers=1)
STANDARD = LATENT.replace(kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0, v_head_dim=0, n_mtp_layers=0)
LAYOUTS = ("tp=8,pp=4,ep=8,cp=2,mbs=1,recompute=selective,sequence_parallel=true",
           "tp=4,pp=2,ep=16,mbs=1,recompute=full,sequence_parallel=true,dispatcher=deepep",
           "tp=2,pp=1,ep=8,mbs=2,recompute=none,sequence_parallel=true,dispatcher=allgather",
           "tp=8,pp=2,vpp=2,ep=4,cp=2,mbs=1,recompute=selective,sequence_parallel=true,ep_comm_overlap=true")


def test_rows_of_a_mixed_batch_equal_their_own_evaluation():
    pairs = [(arch, parse_layout(text).resolve(1024)) for arch in (STANDARD, LATENT) for text in LAYOUTS]
    together = evaluate(ArchBatch.stack([a for a, _ in pairs]), LayoutBatch.stack([lay for _, lay in pairs]),
                        CLUSTER, 1024)
    for i, (arch, lay) in enumerate(pairs):
        alone = evaluate(arch, lay, CLUSTER, 1024)
        assert together.step_time_s[i] == alone.step_time_s[0], (i, arch.kv_lora_rank, LAYOUTS[i % len(LAYOUTS)])
        assert together.memory_per_device_bytes[i] == alone.memory_per_device_bytes[0], i
        for key, value in together.breakdown.items():
            assert value[i] == alone.breakdown[key][0], (i, key)
    assert len({float(s) for s in together.step_time_s}) == len(pairs)  # the rows are different candidates
