"""The transformers backend: architectures no runner family builds (Qwen3, GPT-2) train through
transformers' own model class in the same recipe, on 1 and 2 CPU processes, resume exactly, save
checkpoints transformers loads, train LoRA adapters peft loads, serve and export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from peft import PeftModel
from safetensors.torch import load_file
from torch.utils.data import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.components import instantiate
from runner.config.resolve import resolve_recipe
from runner.data import collate, training_splits
from runner.errors import UserError
from runner.export.write import ExportRequest, export
from runner.models.torchtune_boundary import CROSS_ENTROPY_IGNORE_IDX
from runner.paths import CONF_DIR
from tests.cli_forks import ForkedCli
from tests.conftest import ESTIMATE_DATA, QUICK, deploy_server, losses
from tests.fixtures import write_tiny_checkpoint
from tests.hf_backend_fixtures import ARCHITECTURES, write_arch_checkpoint

CPU = ["compute=cpu", "dtype=fp32"]
# Small and quick: 4 records a rank a step, 8 validation records, no generation.
FAST = [
    *QUICK,
    "batch_size=4",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
    "eval.max_samples=8",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {arch: write_arch_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


def model_args(source: Path) -> list[str]:
    return ["model=hf", f"model.source={source}", *CPU]


def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)


def first_batch(run: Path, world_size: int) -> dict[str, torch.Tensor]:
    """The first optimizer step's records of every rank, as one batch (right padding and
    causal attention: each record's logits do not depend on the others')."""
    recipe = OmegaConf.load(run / "recipe.yaml")
    tokenizer = instantiate(recipe.model.tokenizer)
    dataset, _ = training_splits(recipe.dataset, tokenizer, validation=True)
    samples = []
    for rank in range(world_size):
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=recipe.seed
        )
        samples += [dataset[i] for i in list(sampler)[: recipe.batch_size]]
    return collate(samples, packed=False, padding_idx=tokenizer.pad_id)


def transformers_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """transformers' own loss (it shifts the labels itself) on a runner batch (shifted)."""
    ignore = torch.full_like(batch["labels"][:, :1], CROSS_ENTROPY_IGNORE_IDX)
    labels = torch.cat([ignore, batch["labels"][:, :-1]], dim=1)
    with torch.no_grad():
        return model(input_ids=batch["tokens"], labels=labels).loss.item()


def transformers_eval_loss(model: torch.nn.Module, run: Path) -> float:
    """eval_loss over the run's validation batches (runner's order), by transformers' model."""
    recipe = OmegaConf.load(run / "recipe.yaml")
    tokenizer = instantiate(recipe.model.tokenizer)
    _, validation = training_splits(recipe.dataset, tokenizer, validation=True)
    records = [validation[i] for i in range(min(len(validation), recipe.eval.max_samples))]
    total, count = 0.0, 0
    for start in range(0, len(records), recipe.batch_size):
        batch = collate(
            records[start : start + recipe.batch_size], packed=False, padding_idx=tokenizer.pad_id
        )
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"]).logits
        total += F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
        ).item()
        count += int((batch["labels"] != CROSS_ENTROPY_IGNORE_IDX).sum())
    return total / count


def eval_losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_trains_as_transformers_computes_and_resumes_exactly(
    arch: str, sources: dict[str, Path], runner_cli, tmp_path: Path
) -> None:
    """Step 1's loss is transformers' loss on the same batch; the checkpoint, loaded by
    transformers, has the trained model's eval loss; a resumed run repeats the straight one."""
    straight = tmp_path / "straight"
    result = runner_cli(
        "train",
        *model_args(sources[arch]),
        *FAST,
        "max_steps=4",
        "runtime.save_every_n_steps=2",
        "eval.strategy=steps",
        "eval.steps=4",
        f"hydra.run.dir={straight}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recipe = OmegaConf.load(straight / "recipe.yaml")
    assert recipe.model.backend == "transformers" and recipe.model.family is None
    # fp32 on both sides; the two sum the same per-token losses in another order.
    assert losses(straight)[1] == pytest.approx(
        transformers_loss(hf_model(sources[arch]), first_batch(straight, 1)), abs=1e-5
    )
    checkpoint = straight / "checkpoints" / "step_4"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == arch
    assert eval_losses(straight)[4] == pytest.approx(
        transformers_eval_loss(hf_model(checkpoint), straight), abs=1e-5
    )
    # Cut after the step-2 checkpoint, resumed: the same losses, bit for bit.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(straight, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_4")
    text = (interrupted / "recipe.yaml").read_text().replace(str(straight), str(interrupted))
    (interrupted / "recipe.yaml").write_text(text)
    result = runner_cli("train", f"resume={interrupted}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stderr
    assert losses(interrupted) == losses(straight)


@pytest.mark.parametrize("arch,method", [("qwen3", "full"), ("gpt2", "full"), ("gpt2", "lora")])
def test_trains_on_two_processes_with_activation_checkpointing(
    arch: str, method: str, sources: dict[str, Path], runner_cli, tmp_path: Path
) -> None:
    """FSDP2 shards each decoder layer over 2 gloo processes; step 1's loss is transformers'
    loss over both ranks' records (LoRA's B starts at zero); the gathered checkpoint loads in
    transformers (peft, for LoRA) and differs from the source."""
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *model_args(sources[arch]),
        *FAST,
        f"method={method}",
        "compute.nproc_per_node=2",
        "activation_checkpointing=true",
        "max_steps=2",
        "eval.strategy=no",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # fp32; sums over ranks and tokens in another order than transformers' mean.
    assert losses(run)[1] == pytest.approx(
        transformers_loss(hf_model(sources[arch]), first_batch(run, 2)), abs=1e-5
    )
    checkpoint = run / "checkpoints" / "step_2"
    source = hf_model(sources[arch]).state_dict()
    if method == "lora":
        peft_model = PeftModel.from_pretrained(hf_model(sources[arch]), checkpoint)
        trained = peft_model.merge_and_unload().state_dict()
    else:
        trained = hf_model(checkpoint).state_dict()
    assert trained.keys() == source.keys()
    assert any(not torch.equal(trained[k], v) for k, v in source.items())


@pytest.mark.long  # compiles
def test_compiled_layers_train_as_transformers_computes(sources, runner_cli, tmp_path) -> None:
    """compile=true compiles each decoder layer and the loss (as torchtune's recipes do); step
    1's loss is still transformers'."""
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *model_args(sources["qwen3"]),
        *FAST,
        "compile=true",
        "max_steps=1",
        "eval.strategy=no",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled: each decoder layer, and the loss" in (run / "train.log").read_text()
    # Inductor's fused kernels round differently from eager's, within fp32 noise.
    assert losses(run)[1] == pytest.approx(
        transformers_loss(hf_model(sources["qwen3"]), first_batch(run, 1)), abs=1e-5
    )


# ---- LoRA through peft: adapters peft loads, deploy, export ---------------------------------
LORA = ["method=lora", "method.apply_lora_to_mlp=true", "method.save_merged=true"]


@pytest.fixture(scope="module")
def lora_runs(sources: dict[str, Path], forked_cli: ForkedCli, tmp_path_factory) -> dict[str, Path]:
    """A 2-step LoRA run of each architecture (evaluated at its last step)."""
    runs = {}
    for arch in ARCHITECTURES:
        run = tmp_path_factory.mktemp(f"lora_{arch}") / "run"
        args = [*model_args(sources[arch]), *FAST, *LORA, "max_steps=2", "eval.strategy=steps"]
        argv = ["train", *args, "eval.steps=2", f"hydra.run.dir={run}"]
        proc = forked_cli(argv, run.parent, timeout_s=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[arch] = run
    return runs


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_writes_an_adapter_peft_loads(
    arch: str, sources: dict[str, Path], lora_runs: dict[str, Path], tmp_path: Path
) -> None:
    """peft loads the adapter onto the source and gets the trained model's eval loss; the merged
    weights (the checkpoint's and `runner export` merged) are that model's."""
    run = lora_runs[arch]
    checkpoint = run / "checkpoints" / "step_2"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(sources[arch])
    assert config["peft_type"] == "LORA" and config["r"] == 8
    peft_model = PeftModel.from_pretrained(hf_model(sources[arch]), checkpoint).eval()
    trained = {k: v for k, v in peft_model.state_dict().items() if "lora_B" in k}
    assert trained and all(v.abs().sum() > 0 for v in trained.values())  # B starts at zero
    # fp32; transformers sums the validation losses in another order than the recipe.
    assert eval_losses(run)[2] == pytest.approx(transformers_eval_loss(peft_model, run), abs=1e-5)
    select = {"checkpoint": "latest", "metric": None, "mode": None}
    out = export(
        ExportRequest(
            checkpoint=str(checkpoint),
            select=select,
            format="merged",
            dtype="fp32",
            quantization="f16",
            merged_quantization=None,
            base=None,
            out=str(tmp_path / "merged"),
        )
    )
    ids = first_batch(run, 1)["tokens"][:2]
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        # Merged weights differ from base + adapter by fp32 rounding of W + BA.
        got = hf_model(out)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    merged = load_file(str(checkpoint / "model.safetensors"))
    assert all(
        torch.equal(merged[k], v) for k, v in load_file(str(out / "model.safetensors")).items()
    )


def test_deploy_serves_a_lora_checkpoint(lora_runs: dict[str, Path], hermetic_env, tmp_path):
    """`runner deploy` answers as transformers' generate does with peft's merged model."""
    checkpoint = lora_runs["qwen3"] / "checkpoints" / "step_2"
    served = [f"checkpoint={checkpoint}"]
    with deploy_server(served, cwd=tmp_path, env=hermetic_env, up_within_s=180) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Reverse the word.\nlemon"}]
        chat = client.chat.completions.create(
            model=name, messages=messages, max_tokens=8, temperature=0
        )
    base = json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(hf_model(Path(base)), checkpoint).merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert chat.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)


# ---- which backend, and what it refuses ---------------------------------------------------


def resolved(*overrides: str, tmp_path: Path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return resolve_recipe(cfg, tmp_path / "run")


def test_validate_and_estimate_name_the_backend_and_why(sources, runner_cli, tmp_path) -> None:
    llama = write_tiny_checkpoint("llama3_2", tmp_path / "llama")
    result = runner_cli("validate", *model_args(sources["gpt2"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "ok  backend    transformers: model_type 'gpt2' has no runner family; transformers' "
        "GPT2LMHeadModel" in result.stdout
    )
    result = runner_cli("estimate", *model_args(sources["qwen3"]), "method=lora", ESTIMATE_DATA)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend        transformers: model_type 'qwen3' has no runner family" in result.stdout
    assert "adapter parameters (method=lora)" in result.stdout
    result = runner_cli("estimate", *model_args(llama), ESTIMATE_DATA)
    assert "backend        torchtune: model_type 'llama' is runner's llama3 family" in result.stdout
    recipe = resolved(*model_args(llama), "model.backend=transformers", tmp_path=tmp_path)
    assert recipe.model.backend == "transformers"
    # Padding-free batches need torchtune's block-causal mask: padded in transformers' classes.
    assert not recipe.dataset.padding_free
    assert resolved(*model_args(llama), tmp_path=tmp_path).dataset.padding_free
    assert recipe.model.backend_reason.startswith("model.backend=transformers")


def test_a_family_checkpoint_with_a_setting_torchtune_lacks_trains_through_transformers(
    runner_cli, tmp_path
) -> None:
    """A Llama with biases in attention: torchtune's llama3 builder has none, transformers'
    LlamaForCausalLM builds it, and auto picks it saying why; torchtune is refused by name."""
    biased = tmp_path / "llama_bias"
    shutil.copytree(write_tiny_checkpoint("llama3_2", tmp_path / "llama"), biased)
    config = json.loads((biased / "config.json").read_text()) | {"attention_bias": True}
    (biased / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_pretrained(biased).save_pretrained(biased)  # with its new biases
    result = runner_cli("validate", *model_args(biased))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "ok  backend    transformers: attention_bias=true in config.json, which torchtune's "
        "llama3 builder does not build; transformers' LlamaForCausalLM" in result.stdout
    )
    with pytest.raises(UserError, match="model.backend=auto trains it through") as refused:
        resolved(*model_args(biased), "model.backend=torchtune", tmp_path=tmp_path)
    assert refused.value.key == "model.backend"


@pytest.mark.parametrize(
    "overrides,key,fix",
    [
        (["dataset.packing=true"], "dataset.packing", "set dataset.packing=false"),
        (["dataset.padding_free=true"], "dataset.padding_free", "set dataset.padding_free=false"),
        (
            ["method=qlora", "compute.nproc_per_node=2"],
            "method",
            "bitsandbytes' 4-bit base does not shard over 2 processes; use method=lora",
        ),
        (["model.backend=torchtune"], "model.source", "use model.backend=auto"),
        (["model.backend=keras"], "model.backend", "choose auto, torchtune or transformers"),
    ],
)
def test_what_the_transformers_backend_refuses(sources, tmp_path, overrides, key, fix) -> None:
    with pytest.raises(UserError) as err:
        resolved(*model_args(sources["qwen3"]), *overrides, tmp_path=tmp_path)
    assert err.value.key == key and fix in err.value.fix
