"""Fewer activations kept for backward (runner.models.activation_memory): the same forward, the
same gradients (bit for bit for the feed-forward; within summation order for the CPU's RMSNorm),
fewer bytes saved, on a tiny torchtune Llama on the CPU in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from runner.models.activation_memory import keep_fewer_activations, rms_norm_is_fused
from runner.models.torchtune_boundary import FeedForward, RMSNorm, llama3_2_builders
from tests.conftest import load_script

CPU = torch.device("cpu")
SHAPE = dict(
    vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
    intermediate_dim=192, max_seq_len=128,
)  # fmt: skip
# The RMSNorm's gradient is the same arithmetic as autograd's in another order: a few fp32
# ulps of each value (fp32's epsilon is 1.2e-7), relative to the tensor's largest.
NORM_GRAD_TOLERANCE = 1e-5


def tiny_llama(lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if lora:
        return llama3_2_builders.lora_llama3_2(
            lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4,
            lora_alpha=8, tie_word_embeddings=False, **SHAPE,
        )  # fmt: skip
    return llama3_2_builders.llama3_2(tie_word_embeddings=False, **SHAPE)


def train_step(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.roll(-1).reshape(-1)).backward()
    return logits.detach()


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors the forward keeps for backward, parameters left out (the
    benchmark's own count)."""
    return int(load_script("bench/bench_activations").saved_bytes(model, {"tokens": tokens}))


def test_the_cpu_decomposes_rms_norm() -> None:
    assert not rms_norm_is_fused(CPU)


@pytest.mark.gpu
def test_cuda_runs_the_fused_rms_norm_in_the_inputs_dtype() -> None:
    """torchtune's call gives the fused kernel an fp32 input beside a bf16 weight, which torch
    will not fuse (it warns and runs the decomposition, its last op the cast back to bf16); the
    swapped forward calls it in the input's dtype: one fused op, torchtune's output within a
    bf16 rounding."""
    cuda = torch.device("cuda")
    assert rms_norm_is_fused(cuda)
    plain = RMSNorm(64).to(cuda, torch.bfloat16)
    with torch.no_grad():
        plain.scale.copy_(1 + 0.1 * torch.randn(64))
    lean = keep_fewer_activations(copy.deepcopy(plain), cuda)
    x = torch.randn(2, 30, 64, device=cuda).bfloat16().requires_grad_()
    want, got = plain(x), lean(x)
    assert type(want.grad_fn).__name__ == "ToCopyBackward0"
    assert type(got.grad_fn).__name__ not in ("ToCopyBackward0", "MulBackward0")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16's tolerance: a rounding of each value


def test_the_fused_norms_forward_is_torchtunes_within_a_rounding() -> None:
    """The forward that CUDA's norms get, on the CPU: torchtune's own call where the dtypes of
    input and weight differ (bit for bit), and in a bf16 model's one dtype within a bf16
    rounding (the CPU's rms_norm rounds before the weight's multiply, CUDA's fused kernel
    after)."""
    from runner.models.activation_memory import _rms_norm_fused_forward

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        plain = RMSNorm(64).to(dtype)
        with torch.no_grad():
            plain.scale.copy_(1 + 0.1 * torch.randn(64))
        for x in (torch.randn(2, 30, 64), torch.randn(2, 30, 64).bfloat16()):
            got = _rms_norm_fused_forward(plain, x)
            assert got.dtype == x.dtype
            if x.dtype != dtype or dtype == torch.float32:
                assert torch.equal(got, plain(x)), (dtype, x.dtype)
            else:
                torch.testing.assert_close(got, plain(x))


def test_same_logits_and_gradients_with_fewer_bytes_kept() -> None:
    plain, lean = tiny_llama(), keep_fewer_activations(tiny_llama(), CPU)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    assert torch.equal(train_step(plain, tokens), train_step(lean, tokens))
    for (name, p), q in zip(plain.named_parameters(), lean.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        scale = p.grad.abs().max().clamp(min=1e-30)
        assert ((p.grad - q.grad).abs().max() / scale).item() < NORM_GRAD_TOLERANCE, name
    # Per layer and token: one MLP-wide tensor (SiLU's output) and one model-wide tensor of
    # each of the two norms, and the final norm's, fewer.
    tokens_count = tokens.numel()
    layers, width, mlp = SHAPE["num_layers"], SHAPE["embed_dim"], SHAPE["intermediate_dim"]
    fewer = 4 * tokens_count * (layers * (mlp + 2 * width) + width)
    assert saved_bytes(plain, tokens) - saved_bytes(lean, tokens) == fewer


def test_the_feed_forward_gradients_are_autograds_bit_for_bit() -> None:
    torch.manual_seed(0)
    plain = FeedForward(
        gate_proj=torch.nn.Linear(64, 192, bias=False),
        down_proj=torch.nn.Linear(192, 64, bias=False),
        up_proj=torch.nn.Linear(64, 192, bias=False),
    )
    lean = keep_fewer_activations(copy.deepcopy(plain), CPU)
    x = torch.randn(3, 50, 64)
    grads = []
    for model in (plain, lean):
        inputs = x.clone().requires_grad_()
        model(inputs).pow(2).sum().backward()
        grads.append([inputs.grad, *(p.grad for p in model.parameters())])
    for g_plain, g_lean in zip(*grads, strict=True):
        assert torch.equal(g_plain, g_lean)


def test_the_norm_under_bf16_autocast_gives_torchtunes_output() -> None:
    plain = RMSNorm(64)
    lean = keep_fewer_activations(copy.deepcopy(plain), CPU)
    x = torch.randn(2, 30, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(plain(x), lean(x))
    assert lean(x).dtype == torch.bfloat16


def test_lora_adapters_train_through_the_lean_feed_forward() -> None:
    plain, lean = tiny_llama(lora=True), keep_fewer_activations(tiny_llama(lora=True), CPU)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    assert torch.equal(train_step(plain, tokens), train_step(lean, tokens))
    adapters = [
        (name, p, q)
        for (name, p), q in zip(plain.named_parameters(), lean.parameters(), strict=True)
        if "lora_" in name and ".mlp." in name
    ]
    assert adapters
    for name, p, q in adapters:
        scale = p.grad.abs().max().clamp(min=1e-30)
        assert ((p.grad - q.grad).abs().max() / scale).item() < NORM_GRAD_TOLERANCE, name


def test_a_deep_copy_runs_its_own_weights() -> None:
    lean = keep_fewer_activations(tiny_llama(), CPU)
    twin = copy.deepcopy(lean)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, 16))
    assert not torch.equal(lean(tokens), twin(tokens))
    plain_twin = copy.deepcopy(tiny_llama())
    with torch.no_grad():
        for p in plain_twin.parameters():
            p.mul_(0.5)
    assert torch.equal(twin(tokens), plain_twin(tokens))
