"""What a saved run records about the machine beside pytest-benchmark's own machine info: torch,
backend, device, world size, why that backend, and where there is a GPU its name and the CUDA and
NCCL versions. Comparisons warn when these differ between two runs."""

from __future__ import annotations

import torch
import torch.distributed as dist


def device_name(device: torch.device | str) -> str:
    """``cpu``, or the GPU's name (e.g. ``NVIDIA H100 80GB HBM3``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def software_info(backend: str, device: str, world_size: int, why: str | None = None) -> dict:
    """The ``ddp_bench`` entry of a run's machine info."""
    info = {"torch": torch.__version__, "backend": backend, "device": device, "world_size": world_size}
    if why:
        info["backend_choice"] = why
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        if dist.is_nccl_available():
            info["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return info
