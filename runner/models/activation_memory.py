"""Fewer activations kept for backward, with the same forward: torchtune's SwiGLU feed-forward
and, where torch decomposes it, its RMSNorm, as autograd functions that keep their inputs and
recompute the cheap element-wise rest in backward (what Liger's and Unsloth's kernels do on
GPUs, here in plain torch ops).

Per decoder layer and token, eager autograd keeps four MLP-wide tensors for the feed-forward
(the gate projection, its SiLU, the up projection, their product) and two model-wide ones for
each RMSNorm on the CPU (its input, the normalized input); this keeps three and one. On
bench_peers' default model that is a fifth of the activations of a step.

- The feed-forward's forward and gradients are bit for bit autograd's: backward runs the same
  element-wise ops on the same values, the SiLU recomputed exactly as forward computed it.
- The RMSNorm's forward is bit for bit F.rms_norm's decomposition; its gradients are the same
  arithmetic summed in another order (a few ulps), so it is kept where torch decomposes the norm
  (the CPU): on CUDA, F.rms_norm is one fused kernel that already keeps only x and 1/rms.

On CUDA the fused kernel takes an input and a weight of one dtype, and torchtune's RMSNorm gives
it an fp32 copy of the input beside the weight (bf16 in a bf16 run, or sharded by FSDP2's bf16
policy): torch then warns "Mismatch dtype between input and weight ... Cannot dispatch to fused
implementation" and runs the decomposition, about six kernels over fp32 copies of the
activations forward and more backward, at each of a 1B Llama's 33 norms. There the norm is
called in the input's own dtype, which the fused kernel computes in fp32 as torchtune's upcast
does, writing the input's dtype as torchtune's cast back does.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.models.torchtune_boundary import FeedForward, RMSNorm


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up (not silu(gate)) for backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), grad_up


class _RMSNorm(torch.autograd.Function):
    """x / rms(x) * scale, keeping x and 1/rms (not x / rms) for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        inverse_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, inverse_rms, scale)
        return (x * inverse_rms) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, inverse_rms, scale = ctx.saved_tensors
        grad_scale = None
        if ctx.needs_input_grad[1]:
            grad_scale = (grad * (x * inverse_rms)).sum_to_size(scale.shape)
        grad_normed = grad * scale
        # d(1/rms)/dx = -(1/rms)^3 * x / n, through the sum over the normalized dimension.
        grad_inverse_rms = (grad_normed * x).sum(-1, keepdim=True)
        grad_x = grad_normed * inverse_rms - grad_inverse_rms * inverse_rms.pow(3) * x / x.shape[-1]
        return grad_x, grad_scale, None


# Bound to each module as its forward (a bound method, so that a deep copy of the model binds
# it to the copy).
def _swiglu_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.w2(_SiluMul.apply(self.w1(x), self.w3(x)))


def _rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(x.float(), self.scale, self.eps).to(x.dtype)


def _rms_norm_fused_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != self.scale.dtype:  # the fused kernel's dtypes must agree: torchtune's call
        return F.rms_norm(x.float(), self.normalized_shape, self.scale, self.eps).to(x.dtype)
    return F.rms_norm(x, self.normalized_shape, self.scale, self.eps)


def rms_norm_is_fused(device: torch.device) -> bool:
    """Whether F.rms_norm's backward on `device` keeps only its input and 1/rms already (one
    fused op, CUDA) rather than autograd's decomposition (the CPU)."""
    x = torch.ones(1, 2, device=device, requires_grad=True)
    return type(F.rms_norm(x, (2,), eps=1e-5).grad_fn).__name__ != "MulBackward0"


def keep_fewer_activations(model: nn.Module, device: torch.device) -> nn.Module:
    """Swaps the forward of the model's SwiGLU feed-forwards (torchtune FeedForward with an up
    projection and SiLU) and of its RMSNorms (where F.rms_norm is not fused on `device`, the
    autograd function above; where it is, the fused kernel in the input's dtype) for the
    functions above. Modules of other kinds (Gemma's GELU, Gemma's norms, transformers' own
    modules) are left as they are; the projections stay modules (LoRA, NF4, FSDP see them)."""
    fused_norm = rms_norm_is_fused(device)
    for module in model.modules():
        if (
            type(module) is FeedForward
            and module.w3 is not None
            and type(module.activation) is nn.SiLU
        ):
            module.forward = types.MethodType(_swiglu_forward, module)
        elif type(module) is RMSNorm:
            forward = _rms_norm_fused_forward if fused_norm else _rms_norm_forward
            module.forward = types.MethodType(forward, module)
    return model
