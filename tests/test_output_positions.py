"""logits_at: either backend's model computes its logits at the trained positions only, and the
loss and gradients over them are those over the whole logits with the prompt ignored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from runner.models.backends import logits_at, set_output_chunks
from runner.models.backends.transformers import CausalLM
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX, llama3_2_builders

VOCAB = 64


def torchtune_llama() -> torch.nn.Module:
    return llama3_2_builders.llama3_2(
        vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        intermediate_dim=64, max_seq_len=64,
    )  # fmt: skip


def transformers_llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return CausalLM(LlamaForCausalLM(config))


def loss_over(logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    whole = torch.cat(logits, dim=1) if isinstance(logits, list) else logits
    return F.cross_entropy(
        whole.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=CROSS_ENTROPY_IGNORE_IDX
    )


@pytest.mark.parametrize("chunks", [0, 4])
@pytest.mark.parametrize("build", [torchtune_llama, transformers_llama])
def test_logits_at_the_trained_positions_give_the_same_loss_and_gradients(
    build, chunks: int
) -> None:
    torch.manual_seed(0)
    model = build()
    set_output_chunks(model, chunks)
    tokens = torch.randint(0, VOCAB, (2, 12))
    labels = tokens.clone()
    labels[0, :5] = CROSS_ENTROPY_IGNORE_IDX  # a prompt, and a row's padding
    labels[1, 9:] = CROSS_ENTROPY_IGNORE_IDX
    trained = labels != CROSS_ENTROPY_IGNORE_IDX

    def loss_and_grads(select: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        if select:
            with logits_at(model, trained):
                logits = model(tokens)
            whole = torch.cat(logits, dim=1) if isinstance(logits, list) else logits
            assert whole.shape == (1, int(trained.sum()), VOCAB)
            loss = loss_over(logits, labels[trained].unsqueeze(0))
        else:
            loss = loss_over(model(tokens), labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole_loss, whole_grads = loss_and_grads(select=False)
    loss, grads = loss_and_grads(select=True)
    # The same terms, summed in another order in float32.
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(whole_grads)
    for got, expected in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # Outside it, the logits are whole again.
    logits = model(tokens)
    whole = torch.cat(logits, dim=1) if isinstance(logits, list) else logits
    assert whole.shape == (2, 12, VOCAB)
