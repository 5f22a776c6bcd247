"""Parallelism: rank topology (torch-free), tensor and pipeline parallel modules, device mesh.

Importing this package does not import torch: `topology` and `costs` are shared with the torch-free planner.
"""
