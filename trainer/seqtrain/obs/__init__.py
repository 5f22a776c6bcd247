"""Evaluation, throughput accounting (FLOPs, MFU), TensorBoard, Prometheus, progress, profiling and reports.

The trainer gets these as callbacks (`build_obs_callbacks`); `report.report_command` backs `seqtrain report`.
`flops` and `peaks` are torch-free apart from the device query, so the planner can use them.
"""
