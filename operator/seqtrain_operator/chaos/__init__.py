"""`seqtrain bench chaos`: random faults over many jobs on the test control plane, invariants checked throughout."""
