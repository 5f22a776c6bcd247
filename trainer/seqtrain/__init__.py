"""seqtrain: distributed training of sequence models.

The ``seqtrain.spec`` subpackage is torch-free (the operator image imports it);
everything else may import torch.
"""

__version__ = "0.1.0"
