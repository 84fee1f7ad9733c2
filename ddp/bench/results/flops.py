"""Achieved TFLOP/s and model FLOPs utilisation (MFU) of a step, and the peak they are read against.

    achieved FLOP/s per device = model_flops_per_token * tokens per step per rank / step_seconds
    MFU                        = achieved FLOP/s per device / the device's dense peak in the step's precision

``model_flops_per_token`` is ``ddp.model.model_flops_per_token``: 6 * N + 12 * L * d_model * T
(N the weights of the matrix multiplies, L layers, T the sequence length), the estimate of the
PaLM paper (Chowdhery et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``: model FLOPs, the
work the model needs, not what the hardware did (no recomputation, no causal halving). It is
known for the built-in LM sizes only; other workloads (the MLPs, the conv net, your own) get None.

Peaks are dense (no 2:4 sparsity: the datasheets' starred figures are halved) and come from a
small table of devices whose datasheets we read, matched on ``torch.cuda.get_device_name``. An
unknown device, and the CPU, get None: a peak is never guessed.
"""

from __future__ import annotations

import re

from ddp.model import MODEL_SIZES, model_flops_per_token

# Dense peak TFLOP/s by precision. fp32 is the CUDA cores' (non-tensor) rate; tf32 and bf16 the
# tensor cores', each half of the datasheet's "with sparsity" figure (marked * there).
#   H100 SXM5, H200 SXM, GH200: FP32 67, TF32 989*, BF16 1,979* (NVIDIA H100, H200 and GH200 datasheets)
#   H100 PCIe: FP32 51, TF32 756*, BF16 1,513* (NVIDIA H100 datasheet)
#   H100 NVL, H200 NVL: FP32 60, TF32 835*, BF16 1,671* (NVIDIA H100 and H200 datasheets, per GPU)
#   B200 (HGX B200, 1,000 W): FP32 75, TF32 2.2 P*, BF16 4.5 P* (NVIDIA HGX B200 datasheet, per GPU);
#   the B200 of a GB200 runs at 1,200 W: FP32 80, TF32 2.5 P*, BF16 5 P* (NVIDIA GB200 NVL72 datasheet)
#   A100 SXM4 and PCIe, 40 and 80 GB: FP32 19.5, TF32 156 (312*), BF16 312 (624*) (NVIDIA A100 datasheet)
# Matched in order on ``torch.cuda.get_device_name``: "NVIDIA H100 80GB HBM3" is the SXM5, "NVIDIA
# H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA
# B200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"; the first pattern found decides.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    # (name pattern, what it is, peaks)
    (r"H100.*PCIe", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5}),
    (r"H[12]00.*NVL", "H100 NVL or H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    (r"GH200|H100|H200", "H100 SXM5, H200 SXM or GH200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"GB200", "B200 of a GB200", {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0}),
    (r"B200", "B200 (HGX)", {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0}),
    (r"A100", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of ``device_name`` (``cpu`` or a GPU's name) in ``precision``; None when unknown."""
    if device_name == "cpu":
        return None
    for pattern, _, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def workload_flops_per_token(model: str, seq_len: int) -> float | None:
    """Model FLOPs per trained token of a built-in LM size; None for any other workload."""
    return model_flops_per_token(MODEL_SIZES[model], seq_len) if model in MODEL_SIZES else None


def achieved_tflops(flops_per_token: float | None, tokens_per_rank_step: int, step_seconds: float) -> float | None:
    """Model TFLOP/s one device achieved: its tokens per step times the FLOPs per token, over the step time."""
    if flops_per_token is None or step_seconds <= 0:
        return None
    return flops_per_token * tokens_per_rank_step / step_seconds / 1e12


def mfu(achieved: float | None, device_name: str, precision: str) -> float | None:
    """Achieved over peak, a fraction; None where either is unknown."""
    peak = peak_tflops(device_name, precision)
    return None if achieved is None or peak is None else achieved / peak
