"""Memory per rank: the planner's name for the one estimate, `seqtrain.spec.memory` (torch-free, shared with the
spec's checks and the trainer's `microBatchSize: auto`, which cannot import the operator)."""

from seqtrain.spec.memory import (
    BASELINE_BYTES,
    STATE_BYTES,
    AutoBatch,
    MemoryEstimate,
    ModelStates,
    RankMemory,
    auto_micro_batch,
    block_activation_elems,
    effective_engine,
    estimate,
    fsdp_working_set,
    gib,
    in_flight,
    memory_problems,
    model_state_bytes,
    stage_params,
    state_bytes,
    stored_blocks,
)

__all__ = ["BASELINE_BYTES", "STATE_BYTES", "AutoBatch", "MemoryEstimate", "ModelStates", "RankMemory",
           "auto_micro_batch", "block_activation_elems", "effective_engine", "estimate", "fsdp_working_set", "gib",
           "in_flight", "memory_problems", "model_state_bytes", "stage_params", "state_bytes", "stored_blocks"]
