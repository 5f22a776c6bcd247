"""Torch-free layout arithmetic and rules: rank topology, per-layer costs, which engine combines with which
layout, micro-batch choice. The spec's validation and the operator's planner import it; so does `parallel/`."""
