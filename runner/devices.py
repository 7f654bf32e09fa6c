"""Tensors from the host to a device without the host waiting for the device.

A copy from ordinary (pageable) host memory to CUDA waits for every kernel queued before it, so
a training step's first copy would leave the GPU idle while the host prepares the step, and a
serving step's would stop the host from preparing the next step while the GPU runs this one.
From pinned memory the copy is queued like a kernel and the host goes on (issues 47 and 48).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host to CUDA through pinned memory, without the host
    waiting (the caching host allocator keeps the pinned copy until the device has read it)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
