"""Triton kernels, one module per op (Liger-Kernel layout): kernels + `torch.autograd.Function`.

Importing any module here imports triton and decorates its kernels, which fixes whether they run
compiled (CUDA) or in Triton's CPU interpreter: set `TRITON_INTERPRET=1` before the first import to
use the interpreter. `seqtrain.kernels` imports these lazily, on the first Triton call.
"""
