"""Observers of a run: throughput accounting (FLOPs, MFU), TensorBoard, Prometheus, progress, profiling, reports.

`seqtrain.train.callbacks.build_callbacks` assembles them with evaluation (a training feature, in `train/`);
`report.report_command` backs `seqtrain report`. `flops` and `peaks` are torch-free apart from the device query.
"""
