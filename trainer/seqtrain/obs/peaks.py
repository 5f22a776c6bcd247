"""Peak dense FLOP/s of known accelerators per precision, and MFU / HFU from measured throughput.

Figures are the vendors' datasheet numbers for dense (not 2:4 sparse) math, in TFLOP/s per device. fp32 means
plain FP32 (CUDA cores); "tf32" is what fp32 matmuls run at when PyTorch allows TF32. On a CPU there is no
trustworthy peak, so MFU stays empty unless the spec gives one (`resources.peakTflops`).
"""

from __future__ import annotations

from dataclasses import dataclass

# (substring of torch.cuda.get_device_name(), {precision: dense TFLOP/s}). First match wins, so the more
# specific names (H100 PCIe, L40S, A10G) come before the generic ones they contain. An empty table means
# "known, but no trustworthy figure": MFU stays empty rather than borrow a sibling's peak.
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0}),
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),  # SXM / HBM3
    ("H800", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("GH200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10G", {}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # no bf16 tensor cores
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]


def lookup_peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet peak for a device name and precision ("bf16", "fp16", "tf32", "fp32"); None when unknown."""
    for key, table in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return table.get(precision)
    return None


def matmul_precision(precision: str, allow_tf32: bool) -> str:
    """The peak that applies: spec precision fp32 runs matmuls in TF32 when PyTorch allows it."""
    if precision == "fp32" and allow_tf32:
        return "tf32"
    return precision


def device_peak_flops(precision: str, override_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of this process's device, where the figure came from). None on CPU without an override."""
    if override_tflops is not None:
        return override_tflops * 1e12, "spec"
    import torch

    if not torch.cuda.is_available():
        return None, "cpu: no peak known"
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    peak = lookup_peak_tflops(name, matmul_precision(precision, allow_tf32))
    if peak is None:
        return None, f"{name}: not in the peak table (set spec.resources.peakTflops)"
    return peak * 1e12, name


@dataclass(frozen=True)
class Utilization:
    """Model / hardware FLOPs utilisation of one optimizer step (fractions, not percent)."""

    model_flops_per_s: float
    mfu: float | None
    hfu: float | None


def utilization(
    tokens: float,
    slots: float,
    seconds: float,
    model_flops_per_token: float,
    hardware_flops_per_token: float,
    peak_flops_per_device: float | None,
    devices: int,
) -> Utilization:
    """MFU counts every computed position (`slots`) at the model's FLOPs, as nanoGPT, PaLM, Megatron and torchtitan
    do (counting only target `tokens` halved it on tasks that score half the positions); HFU counts the same
    positions at the FLOPs actually executed (recomputation included). Both divide by the summed device peak.
    `tokens` is kept for callers that report useful throughput beside it."""
    del tokens
    if seconds <= 0:
        return Utilization(0.0, None, None)
    achieved = slots * model_flops_per_token / seconds
    if not peak_flops_per_device or devices <= 0:
        return Utilization(achieved, None, None)
    peak = peak_flops_per_device * devices
    return Utilization(achieved, achieved / peak, slots * hardware_flops_per_token / seconds / peak)
