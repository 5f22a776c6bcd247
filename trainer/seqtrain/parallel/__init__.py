"""Parallelism: tensor, sequence and pipeline parallel modules, the device mesh, gradient utilities.

The torch-free rank arithmetic they share with the spec and the planner is in `seqtrain.layout`.
"""
