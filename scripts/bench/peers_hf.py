"""bench_peers.py's Hugging Face arms: transformers' Trainer on the same checkpoint and samples,
as its user gets it (hf_default) and at its best (hf_best: flattened rows, SDPA, fused AdamW)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from peers_setup import CLIP_GRAD_NORM, IGNORE_INDEX, OPTIMIZER, SEED, StepClock


def run_hf(spec: dict, out: Path, best: bool) -> dict:
    """transformers' Trainer on the checkpoint, fed the ordered pre-tokenized samples: as its
    user gets it (batches padded to the longest sample, optim adamw_torch), or `best`:
    DataCollatorWithFlattening (each batch one row, position_ids restarting per sample, which
    transformers turns into a block-causal mask for SDPA), attn_implementation="sdpa" and
    optim="adamw_torch_fused"."""
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import (
        DataCollatorWithFlattening,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    samples = json.loads(Path(spec["samples"]).read_text())
    dataset = [{"input_ids": s["tokens"], "labels": s["labels"]} for s in samples]
    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    losses = []

    class InOrder(Trainer):
        # Trainer shuffles with its own sampler; the arms train in one order.
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        # Its log rounds the loss to 4 digits; the step's own loss, unrounded.
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(loss.detach())
            return loss

    def collate(batch: list[dict]) -> dict:
        """Padded on the right to the longest sample, as DataCollatorForSeq2Seq pads; no
        attention mask: under the causal mask no real token sees the pad after it."""
        width = max(len(s["input_ids"]) for s in batch)
        pads = [width - len(s["input_ids"]) for s in batch]
        return {
            "input_ids": torch.tensor(
                [s["input_ids"] + [spec["pad_id"]] * n for s, n in zip(batch, pads, strict=True)]
            ),
            "labels": torch.tensor(
                [s["labels"] + [IGNORE_INDEX] * n for s, n in zip(batch, pads, strict=True)]
            ),
        }

    # Flattened, a sample's first label becomes -100 (runner's samples' first label, BOS's,
    # already is): the same trained tokens.
    collator = DataCollatorWithFlattening() if best else collate
    attention = {"attn_implementation": "sdpa"} if best else {}
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32, **attention)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["steps"],
        learning_rate=OPTIMIZER["lr"],
        adam_beta1=OPTIMIZER["betas"][0],
        adam_beta2=OPTIMIZER["betas"][1],
        adam_epsilon=OPTIMIZER["eps"],
        weight_decay=OPTIMIZER["weight_decay"],
        optim="adamw_torch_fused" if best else "adamw_torch",
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=CLIP_GRAD_NORM,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=SEED,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = InOrder(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[Clock()]
    )
    trainer.train()
    return {"losses": [loss.item() for loss in losses], "step_times": clock.step_times()}
