"""seqtrain's control plane: planner, controller core, local and Kubernetes backends, CLI.

Torch-free: the operator image installs only `seqtrain[operator]`.
"""

__version__ = "0.1.0"
