"""method=lora / qlora: only adapters train, checkpoints are PEFT adapters that peft loads onto
the Hugging Face base with our logits, and a resumed LoRA run repeats its losses exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from runner.components import instantiate
from runner.config.resolve import resolve_recipe
from runner.deploy.loading import load_checkpoint
from runner.deploy.selection import resolve_checkpoints
from runner.errors import UserError
from runner.job.preflight import estimate
from runner.models.families import hf_to_tune, peft_to_tune, tune_to_hf, tune_to_peft
from runner.recipes.finetune import FinetuneRecipe
from tests.conftest import ESTIMATE_DATA, QUICK, losses
from tests.test_config import compose_train
from tests.test_resume import straight_then_resumed

STEPS = 6
# A learning rate high enough that the adapters move far from zero in a few steps, so that
# parity below compares a real adapter, not an all-zero lora_B.
TRAIN = [
    *QUICK,
    "compute=cpu",
    "dtype=fp32",
    f"max_steps={STEPS}",
    "batch_size=8",
    "optimizer.lr=1e-2",
    "optimizer.warmup_steps=1",
    "runtime.log_every_n_steps=1",
    "runtime.loggers=[]",
    "dataset.eval_samples=0",
    "method.save_merged=true",
]
# Every base projection of model=tiny holds whole NF4 blocks once it has 8 kv heads.
QLORA = ["method=qlora", "model.builder.num_kv_heads=8"]


def train(runner_cli, run: Path, *overrides: str) -> Path:
    result = runner_cli("train", *TRAIN, *overrides, f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run / "checkpoints" / f"step_{STEPS}"


def nf4_round_trip(base: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The base as a QLoRA run holds it: projections in NF4 (in torchtune's layout), read back
    in bf16 as its state dict gives them."""
    from torchao.dtypes.nf4tensor import to_nf4

    tune = hf_to_tune(base, config)
    for name, weight in tune.items():
        if name.endswith("proj.weight") or ".mlp.w" in name:
            tune[name] = to_nf4(weight).to(torch.bfloat16).to(torch.float32)
    return tune_to_hf(tune, config)


def check_trained_adapters_only(
    run: Path, checkpoint: Path, *, base_dir: Path, quantized: bool
) -> None:
    """Loss fell; the optimizer held adapters only; the merged base is `base_dir`'s."""
    curve = losses(run)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 0.05, curve
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "training_state.pt",
        "config.json",
        "model.safetensors",
    ):
        assert (checkpoint / name).is_file(), name
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    trained = state["optimizer"]["state"]
    assert trained and all(".lora_a." in k or ".lora_b." in k for k in trained), list(trained)
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == base_dir.resolve()
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 8
    base = load_file(str(base_dir / "model.safetensors"))
    if quantized:
        hf_config = json.loads((base_dir / "config.json").read_text())
        base = nf4_round_trip(base, hf_config)
    merged = load_file(str(checkpoint / "model.safetensors"))
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert set(merged) == set(base)
    scale = config["lora_alpha"] / config["r"]
    adapted = 0
    for name, weight in base.items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{module}.lora_A.weight" in adapter:
            lora_a, lora_b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
            assert lora_b.abs().max() > 1e-3, name  # the adapter trained
            base_in_merged = merged[name] - scale * lora_b @ lora_a
            assert torch.allclose(base_in_merged, weight, rtol=0, atol=1e-6), name
            adapted += 1
        else:
            assert torch.equal(merged[name], weight), name  # bit for bit
    assert adapted == 2 * 4  # q_proj and v_proj of 4 layers


def recipe_model(run: Path) -> torch.nn.Module:
    """Our recipe's model (base + the latest checkpoint's adapter), as a resumed run builds it."""
    recipe = FinetuneRecipe(OmegaConf.load(run / "recipe.yaml"))
    recipe.setup()
    recipe.model.set_num_output_chunks(0)  # whole logits, not the chunks the loss wants
    return recipe.model.eval()


def test_lora_trains_adapters_whose_peft_logits_match(runner_cli, tmp_path: Path) -> None:
    # The base: a Hugging Face checkpoint of model=tiny, written by transformers.
    source = tmp_path / "hf_tiny"
    recipe = resolve_recipe(compose_train(["compute=cpu"]), tmp_path)
    hf_config = OmegaConf.to_container(recipe.model.hf_config)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**hf_config)).save_pretrained(source)
    run = tmp_path / "run"
    checkpoint = train(runner_cli, run, "method=lora", f"model.source={source}")
    assert not (run / "base_model").exists()
    check_trained_adapters_only(run, checkpoint, base_dir=source, quantized=False)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft = PeftModel.from_pretrained(base, checkpoint).eval()
        peft_logits = peft(tokens).logits
        ours = recipe_model(run)(tokens)
        # What `runner deploy checkpoint=<this checkpoint>` serves: the adapter merged at load.
        served = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None)
        served_logits = served.model(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter changes the model
    assert (peft_logits - ours).abs().max() <= 1e-4
    assert (served_logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_saving_merged_weights_leaves_training_as_it_was(
    forked_cli, tmp_path: Path, method: str
) -> None:
    """method.save_merged merges the adapter into a copy of the base: in place, each save added
    the adapter into the fp32 base that went on training (step 3 on differed from the run that
    saved no merged weights); model=tiny's NF4 base (runner's own quantization) is copied too."""
    found = []
    for merged in ("true", "false"):
        run = tmp_path / merged
        args = [*TRAIN, f"method={method}", f"method.save_merged={merged}", "max_steps=4"]
        args += ["runtime.save_every_n_steps=2", f"hydra.run.dir={run}"]
        result = forked_cli(["train", *args], tmp_path, timeout_s=600)
        assert result.returncode == 0, result.stderr[-3000:]
        found.append(losses(run))
    assert found[0] == found[1] and len(found[0]) == 4  # bit for bit


def test_a_moved_or_copied_lora_run_merges_onto_its_own_base(runner_cli, tmp_path: Path) -> None:
    # A random-init base: the run writes RUN/base_model/, and its adapters name it by the
    # absolute path it had. Moved, that path is gone; copied, it still holds the original's.
    trained = tmp_path / "trained"
    train(runner_cli, trained, "method=lora", "method.save_merged=false")
    moved = tmp_path / "moved"
    trained.rename(moved)
    copied = tmp_path / "copied"
    shutil.copytree(moved, copied)
    # Another model where the adapters' recorded base was: the copy must not merge onto it.
    decoy = trained / "base_model"
    torch.manual_seed(5)
    LlamaForCausalLM(AutoConfig.from_pretrained(moved / "base_model")).save_pretrained(decoy)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    for run in (moved, copied):
        checkpoint = run / "checkpoints" / f"step_{STEPS}"
        out = tmp_path / f"{run.name}-merged"
        exported = runner_cli("export", f"checkpoint={run}", f"out={out}")
        assert exported.returncode == 0, exported.stderr[-3000:]
        (chosen,) = resolve_checkpoints(
            str(run), names=None, allowed_roots=[], checkpoint="latest", metric=None, mode=None
        )
        served = load_checkpoint(chosen.path, device="cpu", dtype="fp32", max_model_len=None)
        with torch.no_grad():
            own = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(run / "base_model"), checkpoint
            )(tokens).logits
            on_decoy = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(decoy), checkpoint
            )(tokens).logits
            merged = AutoModelForCausalLM.from_pretrained(out)(tokens).logits
            served_logits = served.model(tokens).logits
        assert (own - on_decoy).abs().max() > 1e-2  # the base matters
        assert (merged - own).abs().max() <= 1e-4
        assert (served_logits - own).abs().max() <= 1e-4
    # The adapter config stays as peft wrote it.
    config = json.loads(
        (copied / "checkpoints" / f"step_{STEPS}" / "adapter_config.json").read_text()
    )
    assert config["base_model_name_or_path"] == str(decoy)


def test_lora_adapts_the_default_models_own_output_projection(tmp_path: Path) -> None:
    """model=tiny's output projection is its own (README): method.apply_lora_to_output adapts it,
    with peft's logits for the adapter on lm_head, though torchtune's lora_llama3_2 refuses it."""
    overrides = ["compute=cpu", "method=lora", "method.apply_lora_to_output=true"]
    recipe = resolve_recipe(compose_train(overrides), tmp_path)
    torch.manual_seed(0)
    ours = instantiate(OmegaConf.merge(recipe.model.builder, recipe.method.builder)).eval()
    state = ours.state_dict()
    adapter = {k: 0.1 * torch.randn_like(v) for k, v in state.items() if "lora" in k}
    ours.load_state_dict(adapter, strict=False)
    assert any(k.startswith("output.lora_") for k in adapter), sorted(adapter)
    hf_config = OmegaConf.to_container(recipe.model.hf_config)
    base = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    base.load_state_dict(tune_to_hf({k: v for k, v in state.items() if "lora" not in k}, hf_config))
    target = ["q_proj", "v_proj", "lm_head"]
    theirs = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=target)).eval()
    set_peft_model_state_dict(theirs, tune_to_peft(adapter, hf_config))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours.set_num_output_chunks(0)
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-4


def test_qlora_trains_adapters_on_an_nf4_base(runner_cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    checkpoint = train(runner_cli, run, *QLORA)
    check_trained_adapters_only(run, checkpoint, base_dir=run / "base_model", quantized=True)


def test_lora_resume_gives_identical_losses(runner_cli, tmp_path: Path) -> None:
    straight, resumed = straight_then_resumed(
        runner_cli, tmp_path, "compute=cpu", "method=lora", "method.dropout=0.1", n=3
    )
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == straight  # exact float equality, step by step


def test_adapter_names_and_layouts_round_trip() -> None:
    config = {
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 128,
        "head_dim": 16,
    }
    generator = torch.Generator().manual_seed(0)
    state = {
        "layers.0.attn.q_proj.lora_a.weight": torch.randn(8, 128, generator=generator),
        "layers.0.attn.q_proj.lora_b.weight": torch.randn(128, 8, generator=generator),
        "layers.0.attn.k_proj.lora_b.weight": torch.randn(64, 8, generator=generator),
        "layers.1.mlp.w1.lora_b.weight": torch.randn(512, 8, generator=generator),
    }
    peft = tune_to_peft(state, config)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in peft
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight" in peft
    back = peft_to_tune(peft, config)
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["method=lora", "method.lora_attn_modules=[q_proj,gate]"],
            "method.lora_attn_modules",
            "choose among q_proj, k_proj, v_proj, output_proj",
        ),
        (
            ["method=lora", "method.lora_attn_modules=[]"],
            "method.lora_attn_modules",
            "name at least one attention projection",
        ),
        (
            # torchtune's LoRA attention builders refuse an empty list, MLP adapters or not.
            ["method=lora", "method.lora_attn_modules=[]", "method.apply_lora_to_mlp=true"],
            "method.lora_attn_modules",
            "name at least one attention projection",
        ),
        (
            [
                "method=lora",
                "method.apply_lora_to_output=true",
                "model.builder.tie_word_embeddings=true",
            ],
            "method.apply_lora_to_output",
            "ties its output projection to the embeddings",
        ),
        (["method=lora", "method.rank=0"], "method.rank", "integer >= 1"),
        (["method=lora", "method.alpha=-1"], "method.alpha", "number > 0"),
        (["method=lora", "method.dropout=1.5"], "method.dropout", "[0, 1)"),
        (["method=lora", "method.save_merged=maybe"], "method.save_merged", "true or false"),
    ],
)
def test_bad_method_keys_name_key_value_and_fix(overrides, key, fix, tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve_recipe(compose_train(["compute=cpu", *overrides]), tmp_path)
    assert err.value.key == key and fix in err.value.fix, str(err.value)


def test_lora_settings_the_builder_refuses_are_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever torchtune's LoRA builder refuses that no check of ours names fails at resolve
    time, naming the method, not in the training process (here: the tying check switched off)."""
    monkeypatch.setattr("runner.config.method._ties_embeddings", lambda model: False)
    overrides = ["compute=cpu", "method=lora", "method.apply_lora_to_output=true"]
    tied = [*overrides, "model.builder.tie_word_embeddings=true"]
    with pytest.raises(UserError) as err:
        resolve_recipe(compose_train(tied), tmp_path)
    assert err.value.key == "method" and "lora_llama3_2 refuses" in err.value.fix, str(err.value)


def test_a_bad_method_key_ends_the_cli_with_one_message(runner_cli, tmp_path: Path) -> None:
    result = runner_cli("train", "method=lora", "method.lora_attn_modules=[q_proj,qkv]")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: method.lora_attn_modules=['q_proj', 'qkv']: 'qkv' is not" in result.stderr
    assert "Traceback" not in result.stderr


def test_estimate_counts_adapter_gradients_and_an_nf4_base(tmp_path: Path) -> None:
    found = {
        method: estimate(
            resolve_recipe(compose_train(["compute=cpu", *QLORA[1:], m, ESTIMATE_DATA]), tmp_path)
        )
        for method, m in [("full", "method=full"), ("lora", "method=lora"), ("qlora", QLORA[0])]
    }
    full, lora, qlora = found["full"], found["lora"], found["qlora"]
    # rank 8 on q_proj and v_proj of 4 layers: (128 + 128) x 8 each, A and B.
    assert lora.trainable_parameters == 4 * 2 * (128 * 8 + 8 * 128)
    assert lora.parameters == full.parameters + lora.trainable_parameters
    assert lora.optimizer_bytes == 2 * lora.trainable_parameters * 4
    assert lora.gradients_bytes < full.gradients_bytes / 50
    assert qlora.weights_bytes < lora.weights_bytes / 3


def test_nf4_takes_a_scaler_block_that_divides_and_keeps_the_rest_in_the_compute_dtype() -> None:
    """torchao's NF4 for any projection of whole blocks of 64 weights (the largest scaler block
    up to 256 that divides its blocks; whole 64 x 256 blocks per rank when sharded); one of
    another size stays in the compute dtype, and both train their inputs' gradients."""
    from torch import nn

    from runner.models.nf4 import quantize_base, scaler_block

    assert scaler_block(576 * 576, 1) == 216  # SmolLM2-135M's q_proj: 5184 blocks of 64
    assert scaler_block(1536 * 576, 1) == 256
    assert scaler_block(7 * 10, 1) is None
    assert scaler_block(64 * 512, 2) == 256 and scaler_block(576 * 576, 2) is None
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 7))])
    found = {p.name: p.scaler_block for p in quantize_base(model, world_size=1)}
    assert found == {"layers.0.0": 24, "layers.0.1": None}
    assert type(model.layers[0][0]).__name__ == "FrozenNF4Linear"
    assert type(model.layers[0][1]) is nn.Linear
    x = torch.randn(3, 64, requires_grad=True)
    model.layers[0](x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
