"""Packing and padding-free batches: the same per-token loss as padded batches, through the
config and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from runner.components import instantiate
from runner.config.model import resolve_model
from runner.data import collate, train_dataset
from runner.models.attention import RowAttention
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from runner.paths import SAMPLE_DATA_DIR
from tests.conftest import losses
from tests.test_config import compose_train
from tests.test_data import (
    CPU,
    MODEL_MAX,
    data,
    tokenizer,
    write,
)


def test_packing_without_a_row_length_says_it_packs_the_whole_context(caplog) -> None:
    """Null max_seq_len packs rows of the model's whole context: 131,072 tokens a row for a
    Llama 3.2, where the docs ask for max_seq_len with packing."""
    packed = ["dataset=instruct", f"dataset.source={SAMPLE_DATA_DIR / 'validation.jsonl'}"]
    data(*packed, "dataset.packing=true", "dataset.max_seq_len=96")
    assert "dataset.packing" not in caplog.text
    assert data(*packed, "dataset.packing=true")["max_seq_len"] == MODEL_MAX
    assert (
        "dataset.packing=true packs rows of dataset.max_seq_len tokens, left null: the model's "
        f"whole context, {MODEL_MAX} tokens a row" in caplog.text
    )


def test_packed_and_unpacked_batches_give_the_same_per_token_loss(tmp_path: Path) -> None:
    """On a fixed model: the summed loss and the token count of the same samples agree."""
    torch.manual_seed(0)
    # The builder node as resolved: its family supplies the torchtune builder.
    model = instantiate(OmegaConf.create(resolve_model(compose_train([]).model).builder))
    tok = tokenizer(96)
    base = [
        f"dataset.source={SAMPLE_DATA_DIR / 'validation.jsonl'}",
        "dataset.max_seq_len=96",
        "dataset.split='train[:24]'",
    ]
    plain = train_dataset(data(*base), tok)
    packed = train_dataset(data(*base, "dataset.packing=true"), tok)
    assert sum(len(p["seq_lens"]) for p in packed) > len(packed)  # several samples per pack

    def summed(dataset: Any, is_packed: bool) -> tuple[float, int]:
        batch = collate(
            [dataset[i] for i in range(len(dataset))], packed=is_packed, padding_idx=tok.pad_id
        )
        with torch.no_grad():
            logits = model(batch["tokens"], **RowAttention.of(model, CPU).inputs(batch, CPU))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), reduction="sum"
        )
        return loss.item(), int((batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).sum())

    loss_plain, tokens_plain = summed(plain, False)
    loss_packed, tokens_packed = summed(packed, True)
    assert tokens_plain == tokens_packed > 0
    assert loss_packed == pytest.approx(loss_plain, rel=1e-5)


def test_padding_free_batches_train_each_token_as_padded_batches_do(tmp_path: Path) -> None:
    """Samples of mixed lengths packed into one row, attended per sample: every trained
    token's loss the same as padded (attention stays within each sample, positions restart);
    the multiset of per-token losses shows a leak across samples."""
    torch.manual_seed(0)
    model = instantiate(OmegaConf.create(resolve_model(compose_train([]).model).builder))
    tok = tokenizer(256)
    lines = (SAMPLE_DATA_DIR / "validation.jsonl").read_text().splitlines()[:60]
    words = [json.loads(line)["input"] for line in lines]
    rows = [
        {"instruction": "Reverse:", "input": " ".join(words[:n]), "output": words[n]}
        for n in (40, 3, 17, 1, 9, 25, 2, 12)
    ]
    source = write(rows, tmp_path / "mixed.jsonl")
    samples = list(train_dataset(data(f"dataset.source={source}"), tok))
    attention = RowAttention.of(model, CPU)  # per sample, in one row

    def token_losses(padding_free: bool) -> tuple[torch.Tensor, int]:
        batch = collate(
            samples,
            packed=False,
            padding_free=padding_free,
            padding_idx=tok.pad_id,
            row_limit=attention.row_limit,
        )
        with torch.no_grad():
            logits = model(batch["tokens"], **attention.inputs(batch, CPU))
        labels = batch["labels"].reshape(-1)
        trained = labels != CROSS_ENTROPY_IGNORE_IDX
        each = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1))[trained], labels[trained], reduction="none"
        )
        return each.sort().values, batch["tokens"].shape[0]

    padded, padded_rows = token_losses(False)
    packed, packed_rows = token_losses(True)
    assert padded_rows == len(samples) and packed_rows == 1
    # The same tokens; float32 sums in another order (other row shapes): 1e-5 relative.
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_training_with_packing_through_the_cli(runner_cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        "compute=cpu",
        "dtype=fp32",
        "max_steps=6",
        "batch_size=4",
        "dataset.packing=true",
        "dataset.max_seq_len=256",
        # Six steps of four rows: 512 samples pack into ample rows (all 32,000: seconds).
        "dataset.split='train[:512]'",
        "dataset.eval_samples=0",
        "runtime.log_every_n_steps=1",
        "runtime.save_every_n_steps=null",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = losses(run)
    assert len(found) == 6 and all(map(torch.isfinite, torch.tensor(list(found.values()))))
    assert found[6] < found[1]
    # torchtune's "Packing dataset" bar filled the console; a line of the log says it instead.
    assert "Packing dataset" not in result.stderr
    assert re.search(
        r"data: 512 samples packed into \d+ rows of 256 tokens", (run / "train.log").read_text()
    )
