"""What the layout and attention of padding-free rows cost, in one process: the same training
steps on bench_peers' model and data, with the rows laid out and attended four ways.

    python scripts/bench/bench_row_layout.py [--lengths mixed] [--repeats 3] [--size default]
                                       [--profile]

- one_row_per_sample: runner's layout on the CPU (runner.models.attention.RowAttention): each
  batch one unpadded row, SDPA on each sample's span alone (samples of one length in one call);
- rows_dense: rows as long as the batch's longest sample (first-fit decreasing) under a dense
  block-causal mask: runner's layout before it, and the one it keeps for Gemma 2;
- one_row_dense: one unpadded row under a dense block-causal mask over the whole row: what
  transformers computes for DataCollatorWithFlattening's rows (bench_peers' hf_best arm);
- packs_dense: the samples in torchtune's PackedDataset packs of bench_peers' tune_best arm (in
  order, a new pack where the next sample does not fit, each padded to the longest sample
  rounded up to 128 tokens), under a dense block-causal mask, as torchtune's attention takes it
  on the CPU: tune_best's arithmetic on the same samples as the others, in one process, without
  the run-to-run noise of separate processes.

The model is torchtune's llama3_2 builder at bench_peers' --size (random init, seed 0), fp32 on
the CPU, AdamW (fused), cross-entropy on the whole logits, clip at 1.0: the arithmetic of
bench_peers' bare arm. Each repeat runs every layout over the same 12 batches of 16 samples
(the first left out as warm-up), in turns, the order reversed every other repeat; tokens/s is
the samples' own tokens over the summed step time, given as the median and range over repeats.
--profile then runs 5 steps of runner's layout under torch.profiler and prints where their CPU
time goes, by operator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_setup  # noqa: E402  (the model's shapes and data, as peers_setup.py's)
from torchtune.datasets import PackedDataset  # noqa: E402

from runner.data.transforms import collate  # noqa: E402
from runner.models.attention import RowAttention, dense_block_causal_mask  # noqa: E402

LAYOUTS = ("one_row_per_sample", "rows_dense", "one_row_dense", "packs_dense")
BATCH, STEPS = 16, 12


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", choices=peers_setup.LENGTHS, default="mixed")
    parser.add_argument("--size", choices=peers_setup.SIZES, default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="then profile runner's layout")
    args = parser.parse_args(argv)
    samples = peers_setup.tokenized_samples(args.size, BATCH * STEPS, args.lengths)
    batches = [samples[i * BATCH : (i + 1) * BATCH] for i in range(STEPS)]
    model = peers_setup.random_model(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    per_sample = RowAttention.of(model, torch.device("cpu"))
    # torchtune's own packing of each batch's samples, before the clock runs.
    width = peers_setup.pack_width(samples)
    packs = [list(PackedDataset(b, max_seq_len=width, padding_idx=0)) for b in batches]

    def step(index: int, layout: str) -> int:
        samples = batches[index]
        if layout == "packs_dense":
            batch = collate(packs[index], packed=True, padding_idx=0)
        else:
            limit = None if layout == "rows_dense" else per_sample.row_limit
            batch = collate(
                samples, packed=False, padding_free=True, padding_idx=0, row_limit=limit
            )
        inputs = per_sample.inputs(batch, torch.device("cpu"))
        if inputs and layout != "one_row_per_sample":
            inputs["mask"] = dense_block_causal_mask(batch["input_pos"])
        logits = model(batch["tokens"], **inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sum(len(s["tokens"]) for s in samples)

    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for repeat in range(args.repeats):
        for layout in LAYOUTS if repeat % 2 == 0 else LAYOUTS[::-1]:
            step(0, layout)
            start, tokens = time.perf_counter(), 0
            for index in range(1, STEPS):
                tokens += step(index, layout)
            rates[layout].append(tokens / (time.perf_counter() - start))
    print(f"{args.lengths} lengths, {args.size} model, {args.repeats} repeats; tokens/s:")
    for layout, values in rates.items():
        print(
            f"{layout:<20}{statistics.median(values):>8.0f}"
            f"   range {min(values):.0f}-{max(values):.0f}"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for index in range(1, 6):
                step(index, LAYOUTS[0])
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main(sys.argv[1:])
