"""bench_peers.py's bare arm: a hand-written loop over runner's own batches and attention,
torchtune's builder loaded from the checkpoint, AdamW, cross-entropy, clip: ours/bare is runner's
overhead over the same arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

from peers_setup import CLIP_GRAD_NORM, IGNORE_INDEX, OPTIMIZER, SEED, StepClock


def run_bare(spec: dict, out: Path) -> dict:
    """The hand-written loop: torchtune's builder loaded from the checkpoint, AdamW, CE, clip."""
    import torch
    from safetensors.torch import load_file
    from torchtune.models import convert_weights
    from torchtune.models.llama3_2 import llama3_2

    from runner.data.transforms import collate
    from runner.models.attention import RowAttention

    torch.manual_seed(SEED)
    shape = spec["shape"]
    model = llama3_2(
        vocab_size=shape["vocab"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        embed_dim=shape["hidden"],
        intermediate_dim=shape["mlp"],
        max_seq_len=2048,
        rope_base=500000,
        norm_eps=1e-5,
        scale_factor=1,
        tie_word_embeddings=False,
    )
    hf_state = load_file(Path(spec["checkpoint"]) / "model.safetensors")
    model.load_state_dict(
        convert_weights.hf_to_tune(
            hf_state,
            num_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            dim=shape["hidden"],
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    samples = json.loads(Path(spec["samples"]).read_text())
    size = spec["batch_size"]
    # runner's attention within rows: SDPA per sample, in rows as long as the model takes.
    attention = RowAttention.of(model, torch.device("cpu"))
    losses, clock = [], StepClock()
    for step in range(spec["steps"]):
        # runner's batches: padding-free rows (padded where no two samples share a row), labels
        # shifted to each position's next token.
        batch = collate(
            samples[step * size : (step + 1) * size],
            packed=False,
            padding_free=True,
            padding_idx=spec["pad_id"],
            row_limit=attention.row_limit,
        )
        logits = model(batch["tokens"], **attention.inputs(batch, torch.device("cpu")))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            batch["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clock.tick()
    return {"losses": losses, "step_times": clock.step_times()}
