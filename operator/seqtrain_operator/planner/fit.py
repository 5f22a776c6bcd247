"""Does the memory estimate fit what the job asks for? One verdict for `seqtrain validate`, `plan` and `run` (exit 2
when it does not: a job that cannot fit is an invalid input, caught before any node is tied up); the rule lives
with the estimate in `seqtrain.spec.memory`."""

from seqtrain.spec.memory import gpu_memory_bytes, memory_problems

__all__ = ["gpu_memory_bytes", "memory_problems"]
