"""Padding-free rows and packs: they train what padded batches train, and their attention mask
(dense for SDPA on the CPU, a flex-attention BlockMask where torchtune's attention takes one)
keeps each sample to itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchtune.modules.attention_utils import create_block_causal_mask  # the reference

from runner.data.transforms import InstructToMessages, collate, pack_rows
from runner.models.attention import block_causal_mask, model_inputs, takes_block_mask
from runner.models.tokenizer import ChatTokenizer
from runner.models.torchtune_boundary import (
    CROSS_ENTROPY_IGNORE_IDX,
    SFTTransform,
    gemma2_builders,
    llama3_2_builders,
)
from runner.paths import TINY_TOKENIZER_DIR

# A template with no header: the first message's content is the first token.
CONTENT_FIRST = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
WORDS = ["ab", "cde", "fg hij", "k", "lmnop qr st", "uv", "wxyz a b c", "de"]


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    """A two-layer Llama 3.2 of width 32 (grouped-query attention, as the real ones)."""
    return llama3_2_builders.llama3_2(
        vocab_size=vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        intermediate_dim=64, max_seq_len=256,
    )  # fmt: skip


@pytest.fixture
def content_first_samples(tmp_path: Path) -> list[dict[str, Any]]:
    """Instruct samples of mixed lengths with train_on_input=true under CONTENT_FIRST: each
    sample's first token is trained (its label is not the ignore index)."""
    template = tmp_path / "content_first.jinja"
    template.write_text(CONTENT_FIRST)
    tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR), chat_template=str(template))
    columns = {"instruction": "instruction", "input": None, "output": "output"}
    transform = SFTTransform(InstructToMessages(columns, True, None), tokenizer)
    samples = [
        transform({"instruction": f"Reverse: {words}", "output": words[::-1]}) for words in WORDS
    ]
    assert all(int(s["labels"][0]) == s["tokens"][0] for s in samples)
    return samples


def test_padding_free_trains_as_padded_when_a_samples_first_token_trains(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """No sample's first token is a target of the previous sample's last token in its row: the
    same trained tokens, loss and gradients as the padded batch (one step of the tiny model,
    on the CPU in fp32)."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=ChatTokenizer(str(TINY_TOKENIZER_DIR)).vocab_size)
    pad_id = 0

    def loss_and_grads(padding_free: bool) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        batch = collate(
            content_first_samples, packed=False, padding_free=padding_free, padding_idx=pad_id
        )
        if padding_free:  # the case under test: rows of several samples
            assert batch["tokens"].shape[0] < len(content_first_samples)
        logits = model(batch["tokens"], **model_inputs(batch, torch.device("cpu"), flex=False))
        labels = batch["labels"].reshape(-1)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels, ignore_index=CROSS_ENTROPY_IGNORE_IDX
        )
        model.zero_grad()
        loss.backward()
        trained = int((labels != CROSS_ENTROPY_IGNORE_IDX).sum())
        return loss.detach(), trained, [p.grad.clone() for p in model.parameters()]

    padded_loss, padded_tokens, padded_grads = loss_and_grads(False)
    free_loss, free_tokens, free_grads = loss_and_grads(True)
    assert free_tokens == padded_tokens
    # The same sums over other row shapes: float32 adds in another order (1e-5 relative).
    torch.testing.assert_close(free_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for free, padded in zip(free_grads, padded_grads, strict=True):
        torch.testing.assert_close(free, padded, rtol=1e-4, atol=1e-6)


def test_a_samples_first_label_is_ignored_in_packs_too(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """PackedDataset's packs (samples' positions restarting at 0) lose the same targets."""
    packs = pack_rows(content_first_samples, padding_idx=0)
    batch = collate(packs, packed=True, padding_idx=0)
    starts = batch["input_pos"] == 0
    # Shifted: the position before each sample's first token (and each row's last) trains none.
    before_start = torch.hstack((starts[:, 1:], torch.ones_like(starts[:, :1])))
    assert (batch["labels"][before_start] == CROSS_ENTROPY_IGNORE_IDX).all()
    assert (batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).any()


def test_the_dense_mask_from_positions_is_torchtunes(
    content_first_samples: list[dict[str, Any]],
) -> None:
    packs = pack_rows(content_first_samples, padding_idx=0)
    input_pos = torch.stack([p["input_pos"] for p in packs])
    expected = create_block_causal_mask([p["seq_lens"] for p in packs])
    assert torch.equal(block_causal_mask(input_pos, flex=False), expected)


# flex attention without torch.compile runs unfused, and says so: a forward on a few rows.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_block_mask_attends_as_the_dense_mask(
    content_first_samples: list[dict[str, Any]],
) -> None:
    """The BlockMask that CUDA gets, built here on the CPU: flex attention over it (forward:
    this torch has no CPU backward for flex) equals SDPA over the dense mask."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch = collate(content_first_samples, packed=False, padding_free=True, padding_idx=0)
    assert "mask" in batch  # the CPU's dense mask comes with the batch
    on_cuda = collate(
        content_first_samples, packed=False, padding_free=True, padding_idx=0, on_cuda=True
    )
    assert "mask" not in on_cuda and torch.equal(on_cuda["input_pos"], batch["input_pos"])
    block = model_inputs(on_cuda, torch.device("cpu"), flex=True)["mask"]
    assert isinstance(block, BlockMask)
    rows, width = batch["tokens"].shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, 2, width, 8) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=batch["mask"][:, None]
    )
    # Other kernels, other summation order: float32 to 1e-5.
    torch.testing.assert_close(
        flex_attention(q, k, v, block_mask=block), dense, atol=1e-5, rtol=1e-5
    )


def test_the_cpu_takes_the_dense_mask() -> None:
    model = torch.nn.Linear(2, 2)
    assert not takes_block_mask(model, torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_takes_a_block_mask_except_for_gemma2() -> None:
    llama = tiny_llama(vocab_size=64)
    gemma2 = gemma2_builders.gemma2(
        vocab_size=64, num_layers=1, num_heads=2, head_dim=8, num_kv_heads=1, embed_dim=16,
        intermediate_dim=32, max_seq_len=64,
    )  # fmt: skip
    cuda = torch.device("cuda")
    assert takes_block_mask(llama, cuda) and not takes_block_mask(gemma2, cuda)
