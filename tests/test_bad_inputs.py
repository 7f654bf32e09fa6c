"""A table of bad inputs over every command, each run through the real `runner` CLI.

Each case must end as a user error does: exit 2, no traceback, one message naming the key or
file given (`error: KEY=VALUE: FIX`), and no run directory that claims anything (no status.json
written where the command ran, the input files untouched). The config checks are reached through
`runner validate` or `runner estimate` where they are the same checks `runner train` makes, as
those start no training and cost a subprocess the least; a few go through `runner train` itself
to show it stops before a run directory exists.

Most cases run in a process forked from a server that imported torch, transformers and Hydra once
(tests/cli_forks.py): still the real `runner.cli.main`, one process per case with its own exit
status and output, without ~5 s of imports each. The cases in SUBPROCESS run as a user runs them,
`python -m runner ...` from a fresh interpreter, one per command family.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from runner.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from tests.cli_forks import Forked, ForkedCli
from tests.fixtures import write_tiny_checkpoint

# A deploy or export that wrongly got past its checks would serve or write: not for long.
TIMEOUT_S = 180


class Case(NamedTuple):
    id: str
    argv: list[str]  # "{files}" is the directory of the input files below
    names: list[str]  # what the message must name: the key and, for a file, its path


def case(id: str, argv: str, *names: str) -> object:
    """`argv` split at spaces; `""` is an empty argument."""
    args = ["" if arg == '""' else arg for arg in argv.split()]
    return pytest.param(Case(id, args, list(names)), id=id)


# ---- the table --------------------------------------------------------------------------------
CASES = [
    # unknown commands, options and keys
    case("unknown-command", "trian", "command="),
    case("unknown-key", "validate batch_sise=4", "batch_sise="),
    case("group-removed", "validate ~model", "model:", "~model"),
    # A key runner reads, removed: it fell back on the schema's default, not its YAML's
    # (~max_steps trained 4 epochs, not 1600 steps), or failed where it was read (a traceback
    # for objective.metric, ~runtime.output_root named hydra.run.dir, ~eval objective.metric).
    case("key-removed", "validate ~max_steps", "max_steps:", "~max_steps", "give max_steps=VALUE"),
    case("key-removed-method", "validate method=lora ~method.rank", "method.rank:", "=VALUE"),
    case("key-removed-mandatory", "validate ~objective.metric", "objective.metric:", "=VALUE"),
    case(
        "section-removed", "train compute=cpu max_steps=2 ~eval", "eval:", "~eval", "eval.KEY=VALUE"
    ),
    case(
        "key-removed-run-dir",
        "train compute=cpu max_steps=2 ~runtime.output_root",
        "runtime.output_root:",
        "runtime.output_root=VALUE",
    ),
    case(
        "key-removed-in-sweep",
        "train -m compute=cpu seed=0,1 ~max_steps",
        "max_steps:",
        "~max_steps",
    ),
    case("key-removed-optimizer", "validate ~optimizer.lr", "optimizer.lr:", "optimizer.lr=VALUE"),
    # A null: Hydra removes none ("does not exist"), and said there was no such key.
    case("key-removed-null", "validate ~resume", "~resume:", "null"),
    case("group-null", "validate dtype=null", "dtype=null", "choose one of: auto, bf16"),
    # A number or true/false where an option's name goes: Hydra's ValueError, in a traceback.
    case("group-number", "validate compute=2", "compute='2'", "choose one of: auto, cpu"),
    case("group-bool", "validate optimizer=true", "optimizer='true'", "choose one of: adamw"),
    # A group of the user's own that runner reads nowhere: "no such key" of its contents (a
    # dict), the option not named; runner's own groups added again or as a list: Hydra's words.
    case(
        "own-group-unread",
        "validate --config-dir {files}/conf +mygroup=x",
        "mygroup='x'",
        "runner reads no mygroup group",
        "# @package _global_",
    ),
    case("group-added", "validate +model=tiny", "model='tiny'", "give model=tiny"),
    case("group-force-added", "validate ++model=tiny", "model='tiny'", "give model=tiny"),
    case("group-list", "validate model=[tiny,hf]", "model='[tiny,hf]'", "-m model=tiny,hf"),
    case("family-null", "validate model=tiny model.family=null", "model.family=null", "gemma"),
    case(
        "weight-decay-past-1-over-lr",
        "validate optimizer.lr=1e-3 optimizer.weight_decay=1000",
        "optimizer.weight_decay=1000",
        "give less than 1000 (1/optimizer.lr)",
    ),
    case("momentum-of-1", "validate optimizer=sgd optimizer.momentum=1", "optimizer.momentum=1"),
    case(
        "lora-rank-past-width",
        "validate model=tiny method=lora method.rank=100000",
        "method.rank=100000",
        "give at most 128",
    ),
    case(
        "platform-on-one-machine",
        "validate compute=cpu +compute.platform=slurm",
        "compute.platform='slurm'",
        "compute=multi_node compute.platform=slurm",
    ),
    case("config-name", "validate --config-name nosuch", "--config-name="),
    case("sweep-without-m", "validate seed=choice(1,2)", "seed=", "one value"),
    case("group-comma-list", "validate optimizer=adamw,sgd", "optimizer=", "-m"),
    case("flag-without-value", "validate --config-dir", "--config-dir"),
    # A searchpath entry that is not there: Hydra warned and composed without it (model=mine:
    # "no such option"); a scheme it does not know was a traceback; one entry, not a list, was
    # "override='hydra.searchpath must be a list of strings ...'".
    case(
        "searchpath-no-dir",
        "validate hydra.searchpath=[file:///no/such/dir]",
        "hydra.searchpath='file:///no/such/dir'",
        "no such directory",
    ),
    case(
        "searchpath-no-package",
        "validate hydra.searchpath=[pkg://no_such_package.conf]",
        "hydra.searchpath='pkg://no_such_package.conf'",
        "no such package",
    ),
    case(
        "searchpath-scheme",
        "validate hydra.searchpath=[fle://{files}/conf]",
        "hydra.searchpath='fle://{files}/conf'",
        "file://",
        "pkg://",
    ),
    case(
        "searchpath-not-a-list",
        "validate hydra.searchpath=file://{files}/conf",
        "hydra.searchpath='file://{files}/conf'",
        "hydra.searchpath=[file://{files}/conf]",
    ),
    case("multirun-by-hydra-mode", "estimate hydra.mode=MULTIRUN", "hydra.mode=MULTIRUN"),
    # Each job trained a new directory with no recipe: a FileNotFoundError, jobs failed.
    case("sweep-of-resume", "train -m resume=a,b", "resume='a,b'", "runner resume RUN"),
    case(
        "master-port-past-65535",
        "validate compute=multi_node compute.device=cpu compute.nnodes=2 compute.node_rank=0 "
        "compute.master_addr=127.0.0.1 compute.master_port=70000",
        "compute.master_port=70000",
    ),
    # loss arguments its class checks only as it computes (a traceback at step 0, a failed run)
    case("loss-chunks-type", "validate loss=chunked_ce loss.num_output_chunks=abc", "chunks="),
    case("loss-label-smoothing", "train loss=ce +loss.label_smoothing=2.0", "label_smoothing="),
    # The step scales the loss as a mean: a sum trained 100x too fast, unlike per layout.
    case("loss-reduction-sum", "validate loss=ce +loss.reduction=sum", "loss.reduction='sum'"),
    case("loss-size-average", "validate loss=ce +loss.size_average=false", "loss.size_average="),
    case("optimizer-fused", "validate optimizer.fused=maybe", "optimizer.fused="),
    case("dataset-kind", "validate dataset.kind=qa", "dataset.kind="),
    case(
        "padding-free-and-packing",
        "validate dataset.packing=true dataset.padding_free=true",
        "dataset.padding_free=true",
    ),
    case("clip-grad-norm-nan", "validate clip_grad_norm=nan", "clip_grad_norm=nan"),
    # as typed: the merge into its float field said optimizer.lr=0.0
    case("optimizer-lr-zero", "validate optimizer.lr=0", "optimizer.lr=0:", "> 0"),
    # One format for every source: a .csv validation file read as json was "not valid JSON"
    case(
        "data-format-of-another-file",
        "validate dataset.format=json dataset.validation.source={files}/records.csv",
        "dataset.validation.source=",
        "dataset.format=null",
    ),
    # interpolations that do not resolve: named by the key that holds them, as typed
    case("interpolation-no-key", "train eval.steps=${no.such.key}", "eval.steps=", "no.such.key"),
    case("interpolation-circle", "validate max_steps=${batch_size} batch_size=${max_steps}", "="),
    case("interpolation-env-unset", "validate seed=${oc.env:RUNNER_UNSET_X}", "RUNNER_UNSET_X"),
    case("not-key-value", "validate key=a=b", "override="),
    case("unknown-hydra-flag", "validate --frobnicate", "--frobnicate"),
    # model
    case("model-option", "estimate model=gpt5", "model="),
    case("model-hf-no-source", "estimate model=hf", "model.source="),
    case("model-source-missing", "validate model=hf model.source=/no/such/ckpt", "model.source="),
    case(
        "model-source-file",
        "validate model=hf model.source={files}/notes.txt",
        "model.source=",
        "{files}/notes.txt",
    ),
    case(
        "model-source-empty-dir",
        "validate model=hf model.source={files}/empty_dir",
        "model.source=",
        "{files}/empty_dir",
    ),
    # blamed on model.tokenizer, never given, with transformers' advice to install sentencepiece
    case(
        "model-source-no-tokenizer",
        "validate model=hf model.source={files}/no_tokenizer",
        "model.source=",
        "holds no tokenizer files",
    ),
    # a config.json cut short was a JSONDecodeError traceback
    case(
        "model-config-not-json",
        "validate model=hf model.source={files}/config_not_json",
        "model.source=",
        "config.json is not valid JSON",
    ),
    case(
        "model-weights-cut-short",
        "train model=hf model.source={files}/cut_ckpt",
        "model.source=",
        "{files}/cut_ckpt",
    ),
    case(
        "model-builder-type", "estimate model.builder.num_layers=abc", "model.builder.num_layers="
    ),
    # a count of 0 builds a model with no layers, which fails only in training
    case("model-builder-no-layers", "estimate model.builder.num_layers=0", "num_layers=0", ">= 1"),
    case("model-builder-layers-train", "train model.builder.num_layers=-1", "num_layers=-1"),
    # a real that is no number passed validate and failed the first step with a TypeError; -1
    # made the loss nan, blamed on the learning rate; null failed the build with a traceback
    case("model-builder-eps-type", "validate model.builder.norm_eps=abc", "norm_eps='abc'", "> 0"),
    case("model-builder-rope-base", "validate model.builder.rope_base=-1", "rope_base=-1"),
    case("model-builder-null-scale", "validate model.builder.scale_factor=null", "=null"),
    # the one argument the builder refuses, else all of them (136 / 8 and 128 / 16 divide)
    case(
        "model-builder-one-arg", "validate model.builder.num_heads=7", "model.builder.num_heads=7"
    ),
    case(
        "model-builder-together",
        "validate model.builder.embed_dim=136 model.builder.num_heads=16",
        "model.builder={",
    ),
    # token ids against the model's embedding rows
    case("vocab-too-small", "validate model.builder.vocab_size=200", "model.builder.vocab_size="),
    case(
        "tokenizer-ids-past-vocab",
        "train model.tokenizer={files}/sparse_tokenizer",
        "model.builder.vocab_size=264",
        "token ids up to 5000",
    ),
    case(
        "tokenizer-of-another-model",
        "validate model=hf model.source={files}/full_ckpt model.tokenizer={files}/sparse_tokenizer",
        "model.tokenizer=",
        "{files}/sparse_tokenizer",
    ),
    # dataset
    case("data-missing", "validate dataset.source=/no/such/file.jsonl", "dataset.source="),
    case(
        "data-empty", "train dataset.source={files}/empty.jsonl", "dataset.source=", "empty.jsonl"
    ),
    case(
        "data-malformed-line",
        "validate dataset.source={files}/malformed.jsonl",
        "dataset.source=",
        "line 3",
    ),
    case(
        "data-csv-as-jsonl",
        "validate dataset.source={files}/csv_inside.jsonl",
        "dataset.source=",
        "line 1",
    ),
    case(
        "data-not-utf8", "validate dataset.source={files}/latin1.jsonl", "dataset.source=", "row 2"
    ),
    case(
        "data-wrong-columns",
        "validate dataset.source={files}/qa.jsonl",
        "dataset.column_map.instruction=",
    ),
    case(
        "data-format-mismatch",
        "validate dataset.source={files}/records.jsonl dataset.format=parquet",
        "dataset.source=",
    ),
    case(
        "data-chat-on-instruct",
        "validate dataset=chat dataset.source={files}/records.jsonl",
        "dataset.column_map",
    ),
    case(
        "data-column-twice",
        "validate dataset=instruct dataset.source={files}/records.jsonl "
        "dataset.column_map.output=instruction",
        "dataset.column_map.output='instruction'",
    ),
    case(
        "data-text-eval-samples",
        "validate dataset=text dataset.source={files}/notes.txt dataset.validation.held_out=10% "
        "dataset.eval_samples=3",
        "dataset.eval_samples=3",
    ),
    case(
        "data-held-out-range",
        "validate dataset=instruct dataset.source={files}/records.jsonl "
        "dataset.validation.held_out=150%",
        "dataset.validation.held_out=",
    ),
    # Empty: it was taken for a second validation set beside the sample's source ("set either
    # held_out or a split/source, not both").
    case(
        "data-held-out-empty",
        "validate dataset.validation.held_out=",
        "dataset.validation.held_out=''",
        "give a percentage",
    ),
    # A validation split inside the training split: evaluation scored records it trained on.
    case(
        "data-validation-overlaps",
        "validate dataset=instruct dataset.source={files}/records.jsonl dataset.split=train "
        "dataset.validation.split='train[90%:]'",
        "dataset.validation.split='train[90%:]'",
        "{files}/records.jsonl",
    ),
    case(
        "data-validation-overlaps-stream",
        "validate dataset=instruct dataset.source={files}/records.jsonl dataset.streaming=true "
        "dataset.validation.split='train[90%:]'",
        "dataset.validation.split='train[90%:]'",
    ),
    # the key the user set is named, not the default it collided with
    case(
        "data-column-onto-another",
        "validate dataset=instruct dataset.source={files}/records.jsonl "
        "dataset.column_map.instruction=output",
        "dataset.column_map.instruction='output'",
    ),
    case(
        "data-xml-record-missing",
        "validate dataset=instruct dataset.source={files}/records.xml dataset.xml.record=bogus",
        "dataset.xml.record='bogus'",
        "<item>",
    ),
    case("data-num-workers", "validate dataset.num_workers=1000", "dataset.num_workers=1000"),
    # dtype and loss
    case("dtype-option", "estimate dtype=bf61", "dtype="),
    case("loss-option", "estimate loss=mse", "loss="),
    case("loss-component", "estimate loss._component_=os.system", "loss._component_="),
    case("loss-argument", "validate loss.ignore_index=abc", "loss"),
    case("loss-chunks-zero", "validate loss.num_output_chunks=0", "loss.num_output_chunks=0"),
    case("loss-ignore-index", "validate loss=ce loss.ignore_index=0", "loss.ignore_index=0"),
    # compute
    case(
        "compute-nproc-zero",
        "estimate compute=cpu compute.nproc_per_node=0",
        "compute.nproc_per_node=",
    ),
    case("compute-device", "estimate compute=cpu compute.device=tpu", "compute.device="),
    # method
    case("method-rank", "estimate method=lora method.rank=0", "method.rank="),
    case("method-dropout-high", "estimate method=lora method.dropout=1.5", "method.dropout="),
    case(
        "method-modules",
        "estimate method=lora method.lora_attn_modules=[foo_proj]",
        "method.lora_attn_modules=",
    ),
    case(
        "method-mlp-adapters-only",
        "estimate method=lora method.lora_attn_modules=[] method.apply_lora_to_mlp=true",
        "method.lora_attn_modules=",
    ),
    case(
        "method-output-tied",
        "train method=lora method.apply_lora_to_output=true model.builder.tie_word_embeddings=true",
        "method.apply_lora_to_output=",
    ),
    # a key of another method: it was dropped without a word
    case("method-key-added", "validate method=full +method.rank=4", "method.rank=4", "lora"),
    case(
        "method-key-of-own-option",
        "validate --config-dir {files}/conf method=full_with_rank",
        "method.rank=4",
        "method=lora",
    ),
    case("key-added-twice", "validate method=lora +method.rank=4", "+method.rank", "method.rank="),
    case("key-removed-absent", "validate method=full ~method.rank", "~method.rank"),
    case("group-removed-untyped", "validate ~optimizer", "optimizer:", "~optimizer"),
    case("cluster-method-key", "cluster cluster.print=slurm ++method.rank=4", "method.rank=4"),
    case("method-key-absent", "validate method=full method.beta=0.5", "method.beta=", "dpo"),
    case("method-name", "validate method=lora method.name=full", "method.name=", "method=full"),
    case("method-name-removed", "validate method=lora ~method.name", "method.name:", "method=<"),
    case("method-removed", "validate ~method", "method:", "~method"),
    case(
        "method-eval-metrics",
        "validate method=dpo dataset=preference method.eval_metrics=[eval_exact_match]",
        "method.eval_metrics='eval_exact_match'",
        "eval_rewards_accuracy",
    ),
    # optimizer
    case(
        "optimizer-needs-closure",
        "validate optimizer._component_=torch.optim.LBFGS",
        "optimizer._component_='torch.optim.LBFGS'",
        "closure",
    ),
    case("optimizer-lr-type", "estimate optimizer.lr=fast", "optimizer.lr="),
    case("optimizer-lr-string", "estimate optimizer.lr='1e-3'", "optimizer.lr='1e-3'"),
    case("max-steps-string", "estimate max_steps='12'", "max_steps='12'", "an integer"),
    case(
        "optimizer-betas-short", "train optimizer.betas=[0.9]", "optimizer.betas", "give 2 values"
    ),
    case(
        "sweep-parallel-no-jobs",
        "train -m hydra/launcher=parallel hydra.launcher.n_jobs=0 optimizer.lr=1e-3,2e-3",
        "hydra.launcher.n_jobs=0",
    ),
    case(
        "sweep-parallel-jobs-type",
        "train -m hydra/launcher=parallel hydra.launcher.n_jobs=abc optimizer.lr=1e-3,2e-3",
        "hydra.launcher.n_jobs='abc'",
        "give a whole number",
    ),
    case("optimizer-betas-range", "estimate optimizer.betas=[1.5,0.9]", "optimizer.betas"),
    case("optimizer-weight-decay", "estimate optimizer.weight_decay=-1", "optimizer.weight_decay"),
    case("optimizer-argument", "estimate optimizer.momentum=0.9", "optimizer.momentum"),
    case(
        "optimizer-component", "estimate optimizer._component_=os.system", "optimizer._component_="
    ),
    # runtime
    case(
        "runtime-save-every", "estimate runtime.save_every_n_steps=0", "runtime.save_every_n_steps="
    ),
    case("runtime-loggers", "estimate runtime.loggers=[maybe]", "runtime.loggers="),
    # '': the runs went to the file system's root (/<date>/<time>)
    case(
        "runtime-output-root-empty",
        "train runtime.output_root=''",
        "runtime.output_root='': an empty path (runs at the file system's root)",
    ),
    case(
        "runtime-multirun-root-empty",
        "train -m runtime.multirun_root= seed=1,2",
        "runtime.multirun_root='': an empty path",
    ),
    case(
        "runtime-multirun-root-a-file",
        "train -m runtime.multirun_root={files}/full_ckpt/config.json/mr seed=1,2",
        "runtime.multirun_root=",
        "Not a directory",
    ),
    case(
        "runtime-output-root-a-file",
        "train runtime.output_root={files}/full_ckpt/config.json/runs",
        "runtime.output_root=",
        "Not a directory",
    ),
    # eval and objective
    case("eval-strategy", "estimate eval.strategy=sometimes", "eval.strategy="),
    case("objective-mode", "estimate objective.mode=up", "objective.mode="),
    # training keys
    case("max-steps", "train max_steps=0", "max_steps="),
    case("resume-missing", "train resume=/no/such/run", "resume="),
    case("resume-not-a-run", "train resume={files}/not_a_run", "resume=", "{files}/not_a_run"),
    # download
    case("download-type", "download batch_size=abc", "batch_size="),
    case("download-model-no-source", "download model=hf", "model.source="),
    case("download-dataset-no-source", "download dataset=instruct", "dataset.source="),
    # deploy
    case("deploy-no-checkpoint", "deploy", "checkpoint"),
    case("deploy-port-type", "deploy checkpoint={files}/full_ckpt port=abc", "port="),
    case("deploy-port-range", "deploy checkpoint={files}/full_ckpt port=-1", "port="),
    case("deploy-port-string", "deploy checkpoint={files}/full_ckpt port='8000'", "port='8000'"),
    case(
        "deploy-not-a-checkpoint", "deploy checkpoint={files}/not_a_run", "checkpoint=", "not_a_run"
    ),
    # A run over with no checkpoint: none will come by waiting (it said "wait for one").
    case(
        "deploy-ended-without-checkpoint",
        "deploy checkpoint={files}/old_run",
        "ended completed with no whole checkpoint",
    ),
    case("deploy-cut-short", "deploy checkpoint={files}/cut_ckpt", "checkpoint=", "cut_ckpt"),
    case("deploy-unknown-key", "deploy checkpoint={files}/full_ckpt prot=9000", "prot="),
    # train's compute group carried over: deploy's own key is device
    case(
        "deploy-compute", "deploy checkpoint={files}/full_ckpt compute=cpu", "compute=", "device="
    ),
    # export
    case("export-format", "export checkpoint={files}/full_ckpt format=onnx", "format="),
    case(
        "export-merged-dtype",
        "export checkpoint={files}/full_ckpt merged.dtype=fp8",
        "merged.dtype=",
    ),
    case("export-bare-dtype", "export checkpoint={files}/full_ckpt dtype=bf16", "dtype="),
    case("export-no-weights", "export checkpoint={files}/no_weights", "checkpoint=", "no_weights"),
    case("export-cut-short", "export checkpoint={files}/cut_ckpt", "checkpoint=", "cut_ckpt"),
    # repro
    case("repro-not-a-run", "repro {files}/not_a_run", "RUN_DIR=", "not_a_run"),
    case("repro-steps-zero", "repro {files}/old_run --steps 0", "--steps"),
    case("repro-tolerance", "repro {files}/old_run --tolerance -1", "--tolerance"),
    case(
        "repro-out-exists", "repro {files}/old_run --out {files}/not_a_run", "--out=", "not_a_run"
    ),
    case("repro-old-recipe", "repro {files}/old_run --out {files}/fresh", "recipe.yaml", "old_run"),
    # argparse's own refusals, worded as the Hydra commands' are
    case("repro-steps-type", "repro {files}/old_run --steps abc", "--steps='abc'", "an integer"),
    case("repro-no-run-dir", "repro", "RUN_DIR: missing", "usage: runner repro"),
    case("push-no-target", "push {files}/full_ckpt", "to: missing", "usage: runner push"),
    case("logs-unknown-flag", "logs {files}/old_run -n 3", "argument='-n 3'"),
    case("stop-timeout-type", "stop {files}/old_run --timeout soon", "--timeout='soon'"),
    case("stop-timeout-negative", "stop {files}/old_run --timeout -5", "--timeout='-5'", "> 0"),
    # as typed: argparse's float of it said --timeout=0.0
    case("stop-timeout-zero", "stop {files}/old_run --timeout 0", "--timeout='0'", "> 0"),
    # lifecycle
    case("runs-missing-dir", "runs /no/such/dir", "DIR=", "/no/such/dir"),
    case("logs-not-a-run", "logs {files}/not_a_run", "RUN=", "not_a_run"),
    case("stop-not-a-run", "stop {files}/not_a_run", "RUN=", "not_a_run"),
    case("resume-completed", "resume {files}/old_run", "RUN=", "old_run"),
    # An empty path (`key=`, or `key=$DIR` of an unset variable) names the working directory:
    # a run, a sweep or a resume was made there among the user's files, an export written by
    # default, and a run, data or a checkpoint looked for there.
    case("empty-run-dir", "train compute=cpu max_steps=2 hydra.run.dir=", "hydra.run.dir=''"),
    case(
        "empty-sweep-dir",
        "train -m compute=cpu max_steps=2 seed=0,1 hydra.sweep.dir=",
        "hydra.sweep.dir=''",
    ),
    case("empty-resume", "train resume=", "resume=''", "runner resume RUN"),
    case("empty-source", "validate dataset.source=", "dataset.source=''", "give a data file"),
    case("empty-export-checkpoint", "export checkpoint=", "checkpoint=''"),
    case("empty-export-out", "export checkpoint={files}/full_ckpt out=", "out=''", "out=PATH"),
    case("empty-resume-run", 'resume ""', "RUN=''", "give a run directory"),
    case("empty-stop-run", 'stop ""', "RUN=''"),
    case("empty-runs-dir", 'runs ""', "DIR=''"),
    case("empty-repro-run", 'repro ""', "RUN_DIR=''"),
    case("empty-repro-out", 'repro {files}/old_run --out ""', "--out=''"),
    case("empty-push-path", 'push "" hf://org/name', "path=''"),
    case("empty-cache-dir", "validate runtime.cache_dir=", "runtime.cache_dir=''"),
    case("empty-download-cache-dir", "download runtime.cache_dir=", "runtime.cache_dir=''"),
    case(
        "empty-shared-dir",
        "cluster cluster.print=slurm cluster.shared_dir=",
        "cluster.shared_dir=''",
        "root",
    ),
    # An empty reference, not a token: it was shown as a hidden secret pasted as a value.
    case("empty-token-file", "validate runtime.hf_token=file:", "runtime.hf_token='file:'"),
    case("empty-token-env", "validate runtime.hf_token=env:", "runtime.hf_token='env:'"),
    case(
        "empty-api-key-file", "deploy checkpoint={files}/full_ckpt api_key.file=", "api_key.file=''"
    ),
    # cluster
    case("cluster-nodes", "cluster cluster.nodes=0", "cluster.nodes="),
    case("cluster-shared-dir", "cluster cluster.shared_dir=/shared/$HOME", "cluster.shared_dir="),
    case("cluster-unknown-key", "cluster cluster.gpus=4", "cluster.gpus="),
    case("cluster-train-key", "cluster batch_sise=3", "batch_sise="),
    # A fused SGD step on weights sharded over the job's 2 x 8 processes: every node refused it.
    case("cluster-fused-sgd", "cluster optimizer=sgd optimizer.fused=true", "optimizer.fused=true"),
    case("cluster-multirun", "cluster -m max_steps=1,2", "-m:", "hydra/launcher=slurm"),
    case("cluster-slurm-time", "cluster cluster.slurm.time=forever", "cluster.slurm.time="),
]
if not torch.cuda.is_available():
    CASES.append(case("compute-gpu-without-one", "validate compute=gpu", "compute="))
# Run from a fresh interpreter, as `runner` itself is: one case of each kind of command.
SUBPROCESS = {
    "unknown-command",
    "unknown-key",
    "data-empty",
    "deploy-cut-short",
    "export-cut-short",
    "repro-not-a-run",
    "logs-not-a-run",
    "cluster-nodes",
}


# ---- the input files -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bad (and the few good) inputs the table points at, made once."""
    root = tmp_path_factory.mktemp("inputs")
    good = (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()[:20]
    (root / "records.jsonl").write_text("\n".join(good) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "malformed.jsonl").write_text("\n".join([*good[:2], '{"instruction": oops}']) + "\n")
    (root / "csv_inside.jsonl").write_text("instruction,input,output\nUpper:,ab,AB\n")
    (root / "records.csv").write_text("instruction,input,output\nUpper:,ab,AB\n")
    item = "<item><instruction>Upper:</instruction><input>ab</input><output>AB</output></item>"
    (root / "records.xml").write_text(f"<rows>{item * 20}</rows>")
    # A user's own method option (--config-dir) with a key its method does not read.
    (root / "conf" / "method").mkdir(parents=True)
    (root / "conf" / "method" / "full_with_rank.yaml").write_text(
        "defaults:\n  - full\n  - _self_\n\nrank: 4\n"
    )
    # A group of the user's own, which runner does not read.
    (root / "conf" / "mygroup").mkdir()
    (root / "conf" / "mygroup" / "x.yaml").write_text("lr: 0.1\n")
    (root / "latin1.jsonl").write_bytes(
        (good[0] + "\n").encode()
        + '{"instruction": "caf\xe9", "input": "", "output": "x"}\n'.encode("latin-1")
    )
    (root / "qa.jsonl").write_text('{"question": "1+1", "answer": "2"}\n' * 20)
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "empty_dir").mkdir()
    (root / "not_a_run").mkdir()
    (root / "not_a_run" / "readme.txt").write_text("just a directory\n")

    # A tokenizer whose eos token's id (5000) is past its vocabulary's size (264): the model's
    # embedding (model=tiny: 264 rows) needs a row for every id, not for len(tokenizer).
    sparse = root / "sparse_tokenizer"
    shutil.copytree(TINY_TOKENIZER_DIR, sparse)
    tokenizer = json.loads((sparse / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["<|eot_id|>"] = 5000
    for token in tokenizer["added_tokens"]:
        if token["content"] == "<|eot_id|>":
            token["id"] = 5000
    (sparse / "tokenizer.json").write_text(json.dumps(tokenizer))

    full = write_tiny_checkpoint("llama3_2", root / "full_ckpt")
    cut = root / "cut_ckpt"
    shutil.copytree(full, cut)
    weights = cut / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shutil.copytree(full, root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    shutil.copytree(full, root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "no_tokenizer" / name).unlink(missing_ok=True)
    shutil.copytree(full, root / "config_not_json")
    (root / "config_not_json" / "config.json").write_text('{"model_type": "llama", ')

    # A completed run recorded by a runner of an older recipe layout.
    old = root / "old_run"
    old.mkdir()
    (old / "status.json").write_text(
        json.dumps({"state": "completed", "step": 4, "total_steps": 4})
    )
    (old / "recipe.yaml").write_text("run_dir: old_run\nmodel: {name: tiny}\n")
    (old / "manifest.json").write_text(json.dumps({"overrides": []}))
    (old / "train.log").write_text("step 4/4\n")
    return root


def run_case(
    bad: Case, argv: list[str], cwd: Path, env: dict[str, str], forked_cli: ForkedCli
) -> subprocess.CompletedProcess | Forked:
    """`runner ARGV` in `cwd`: from a fresh interpreter for the SUBPROCESS cases, else forked."""
    if bad.id not in SUBPROCESS:
        return forked_cli(argv, cwd, TIMEOUT_S)
    return subprocess.run(
        [sys.executable, "-m", "runner", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


# ---- the test --------------------------------------------------------------------------------
OUTCOMES: list[tuple[str, bool]] = []


@pytest.mark.parametrize("bad", CASES)
def test_bad_input(
    bad: Case, files: Path, hermetic_env: dict[str, str], forked_cli: ForkedCli, tmp_path: Path
) -> None:
    argv = [arg.replace("{files}", str(files)) for arg in bad.argv]
    names = [name.replace("{files}", str(files)) for name in bad.names]
    before = snapshot(files)
    passed = False
    try:
        proc = run_case(bad, argv, tmp_path, hermetic_env, forked_cli)
        stderr = proc.stderr
        assert proc.returncode == 2, f"exit {proc.returncode}\n{stderr[-3000:]}"
        assert "Traceback" not in stderr, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if "error: " in line]
        assert len(errors) == 1, stderr[-3000:]
        for name in names:
            assert name in errors[0], f"{name!r} not in {errors[0]!r}"
        claimed = list(tmp_path.rglob("status.json"))
        assert not claimed, f"a run directory was left: {claimed}"
        assert snapshot(files) == before, "an input was changed or written into"
        passed = True
    finally:
        OUTCOMES.append((bad.id, passed))


def test_print_the_count() -> None:
    """The table's count, for the closing note of issue 20 (run after the cases above)."""
    failed = [id for id, passed in OUTCOMES if not passed]
    print(
        f"\nbad-input table: {len(OUTCOMES)} cases, {len(OUTCOMES) - len(failed)} passed, "
        f"{len(failed)} failed" + (f" ({', '.join(failed)})" if failed else "")
    )
