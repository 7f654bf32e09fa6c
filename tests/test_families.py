"""Model families: tiny real checkpoints of each, written by transformers, through our code.

For each family: the recipe's model gives transformers' logits, our tokenizer path gives
transformers' ids (chat template included), and `runner train model=hf model.source=DIR` trains
it into a checkpoint transformers loads; as hf://org/name it loads from a hub cache snapshot.
The zoo options' dimensions match the published config.json of their hub repos.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.checkpoint import read_model_state
from runner.components import instantiate
from runner.deploy.loading import load_checkpoint
from runner.errors import UserError
from runner.families import (
    builder_args,
    check_source_matches,
    family_named,
    family_of,
    read_config,
    tune_to_peft,
)
from runner.models import resolve_model
from runner.paths import CONF_DIR
from runner.preflight import estimate, print_estimate
from runner.resolve import resolve_recipe
from runner.tune import Message
from tests.conftest import losses
from tests.fixtures import FAMILIES, write_hub_snapshot, write_tiny_checkpoint

ZOO = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
CHATS = {
    "system, user, assistant": [
        ("system", "Answer briefly. "),
        ("user", "Reverse the word.\nhello"),
        ("assistant", " olleh"),
    ],
    "user, assistant, user, assistant": [
        ("user", "Uppercase the word.\nfox"),
        ("assistant", "FOX"),
        ("user", "Reverse the word.\ndog"),
        ("assistant", "god"),
    ],
}
PROMPTS = {
    "system, user": [("system", "Answer briefly."), ("user", "Reverse the word.\nhello")],
    "user": [("user", "Uppercase the word.\nquick")],
}


def model_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides).model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_checkpoint(family, root / family) for family in FAMILIES}


@functools.cache
def resolved(source: Path) -> dict:
    """model=hf's recipe model section for a source."""
    return resolve_model(model_config(["model=hf", f"model.source={source}"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_model_gives_transformers_logits(checkpoints: dict[str, Path], family: str) -> None:
    source = checkpoints[family]
    ours = instantiate(OmegaConf.create(resolved(source)["builder"]))
    ours.load_state_dict(read_model_state(source))
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5"])
def test_an_adapter_in_peft_gives_the_lora_models_logits(checkpoints, family: str) -> None:
    """Adapter names and layouts per family: Llama's q/k rows are permuted, Qwen2's are not."""
    source = checkpoints[family]
    lora = {"lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "lora_rank": 4}
    recipe = resolved(source)
    builder = {
        **recipe["builder"],
        "_component_": recipe["lora_builder"],
        **lora,
        "lora_alpha": 8,
    }
    ours = instantiate(OmegaConf.create(builder))
    ours.load_state_dict(read_model_state(source), strict=False)
    torch.manual_seed(0)
    adapter = {name: torch.randn_like(t) for name, t in ours.state_dict().items() if "lora" in name}
    ours.load_state_dict(adapter, strict=False)
    target = ["q_proj", "k_proj", "v_proj", "o_proj"]
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    theirs = get_peft_model(theirs, LoraConfig(r=4, lora_alpha=8, target_modules=target))
    set_peft_model_state_dict(theirs, tune_to_peft(adapter, read_config(source)))
    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


def messages(chat: list[tuple[str, str]], train_on_input: bool = False) -> list[Message]:
    return [
        Message(role=role, content=text, masked=role != "assistant" and not train_on_input)
        for role, text in chat
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_gives_the_chat_templates_ids(checkpoints: dict[str, Path], family: str) -> None:
    source = checkpoints[family]
    ours = instantiate(OmegaConf.create(resolved(source)["tokenizer"]))
    hf = AutoTokenizer.from_pretrained(source)
    # The model transform the recipe runs, and transformers' own rendering of the conversation.
    for name, chat in CHATS.items():
        tokens, mask = ours.tokenize_messages(messages(chat))
        dicts = [{"role": role, "content": text} for role, text in chat]
        expected = hf.apply_chat_template(dicts, tokenize=True, return_dict=False)
        assert tokens == list(expected), name
        # Only the answers (and their end token) are trained on.
        runs, run = [], []
        for token, masked in zip(tokens, mask, strict=True):
            if not masked:
                run.append(token)
            elif run:
                runs, run = [*runs, run], []
        runs += [run] if run else []
        answers = [text.strip() for role, text in chat if role == "assistant"]
        assert [hf.decode(r, skip_special_tokens=True).strip() for r in runs] == answers, name
        assert all(r[-1] == ours.eos_id for r in runs), name
    for name, chat in PROMPTS.items():
        dicts = [{"role": role, "content": text} for role, text in chat]
        expected = hf.apply_chat_template(
            dicts, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ours.generation_prompt(messages(chat)) == list(expected), name


@pytest.mark.parametrize("family", FAMILIES)
def test_train_on_input_trains_on_the_prompt_too(checkpoints: dict[str, Path], family: str) -> None:
    ours = instantiate(OmegaConf.create(resolved(checkpoints[family])["tokenizer"]))
    chat = CHATS["system, user, assistant"][1:]
    _, masked = ours.tokenize_messages(messages(chat))
    _, unmasked = ours.tokenize_messages(messages(chat, train_on_input=True))
    assert sum(not m for m in unmasked) > sum(not m for m in masked) + 5


@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5", "mistral"])
def test_runner_trains_a_source_of_each_family(
    checkpoints: dict[str, Path], family: str, runner_cli, tmp_path: Path
) -> None:
    source, run_dir = checkpoints[family], tmp_path / "run"
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        "compute=cpu",
        "max_steps=2",
        "batch_size=2",
        "dataset.eval_samples=2",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        "runtime.log_every_n_steps=1",
        f"hydra.run.dir={run_dir}",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2]
    checkpoint = run_dir / "checkpoints" / "step_2"
    # Saved in the format loaded: the source's config.json and tokenizer files, HF names.
    config = json.loads((checkpoint / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "dtype"} == {
        k: v for k, v in original.items() if k != "dtype"
    }
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (checkpoint / name).read_bytes() == (source / name).read_bytes(), name
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint)
    before = AutoModelForCausalLM.from_pretrained(source)
    recipe = OmegaConf.load(run_dir / "recipe.yaml")
    ours = instantiate(recipe.model.builder)
    ours.load_state_dict(read_model_state(checkpoint))
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = theirs(tokens).logits
        assert (ours(tokens) - logits).abs().max().item() <= 1e-4
        assert (before(tokens).logits - logits).abs().max().item() > 1e-4  # it trained
    # `runner deploy` loads it, and renders a chat into the ids training used for the prompt.
    served = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    prompt = PROMPTS["system, user"]
    rendered = served.tokenizer.apply_chat_template(
        [{"role": role, "content": text} for role, text in prompt],
        add_generation_prompt=True,
        tokenize=False,
    )
    trained_with = instantiate(recipe.model.tokenizer)
    assert served.tokenizer.encode(rendered, add_special_tokens=False) == (
        trained_with.generation_prompt(messages(prompt))
    )
    assert trained_with.eos_id in served.eos_token_ids


def test_every_model_option_gets_its_familys_builder_and_lora_twin() -> None:
    for option in ZOO:
        model = model_config([f"model={option}"])
        for key in ("family", "source", "tokenizer", "chat_template", "checkpoint_format"):
            assert key in model, (option, key)
        if model.builder is not None:
            recipe = resolve_model(model, need_files=False)
            builders = family_named(model.family).builders
            assert recipe["lora_builder"] == builders[recipe["builder"]["_component_"]], option


# The published config.json of each zoo option's hub repo (the keys that shape the model).
_LLAMA = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "num_key_value_heads": 8,
}
_LLAMA_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_QWEN = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": 32768,
}
PUBLISHED = {
    "llama3_2_1b": {
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama3_2_3b": {
        **_LLAMA,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "num_hidden_layers": 28,
        "head_dim": 128,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama3_1_8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rope_scaling": {**_LLAMA_ROPE, "factor": 8.0},
        "tie_word_embeddings": False,
    },
    "qwen2_5_0_5b": {
        **_QWEN,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2_5_1_5b": {
        **_QWEN,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2_5_7b": {
        **_QWEN,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "mistral_7b": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("option", sorted(PUBLISHED))
def test_zoo_option_builds_its_hub_repos_model(option: str) -> None:
    model = model_config([f"model={option}"])
    assert model.source.startswith("hf://") and "-Instruct" in model.source
    config = PUBLISHED[option]
    family = family_of(config, model.source)
    assert family.name == model.family
    # Raises unless every argument but max_seq_len agrees with the config.json.
    check_source_matches(
        family,
        OmegaConf.to_container(model.builder),
        builder_args(family, config, ""),
        model.source,
    )
    assert model.builder.max_seq_len == config["max_position_embeddings"]


def test_estimate_of_a_zoo_option_needs_no_download(capsys, tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["model=llama3_2_1b", "compute=cpu", "dtype=bf16"]
        cfg = compose("train", overrides=[*overrides, f"runtime.cache_dir={tmp_path}"])
    recipe = resolve_recipe(cfg, tmp_path, fetch=False)
    print_estimate(recipe, estimate(recipe))
    # Llama 3.2 1B's published parameter count; the data needs the tokenizer, not here.
    out = capsys.readouterr().out
    assert "1,235,814,400 parameters, bf16" in out and "activations    not estimated" in out


def test_a_source_the_option_does_not_build_is_a_user_error(checkpoints: dict[str, Path]) -> None:
    qwen = checkpoints["qwen2_5"]
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=qwen2_5_0_5b", f"model.source={qwen}"]))
    assert err.value.key == "model.source" and "model=hf" in err.value.fix
    assert "embed_dim" in err.value.fix or "vocab_size" in err.value.fix
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=llama3_2_1b", f"model.source={qwen}"]))
    assert err.value.key == "model.source" and "qwen2" in err.value.fix
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=hf"]))
    assert err.value.key == "model.source"


def test_weights_that_do_not_fit_the_config_are_a_user_error(checkpoints, tmp_path) -> None:
    source = tmp_path / "edited"
    shutil.copytree(checkpoints["qwen2_5"], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=hf", f"model.source={source}"]))
    assert err.value.key == "model.source"
    assert "layers.0.mlp.w1.weight is [128, 64]" in err.value.fix


def test_a_chat_template_that_is_not_a_file_is_a_user_error(checkpoints) -> None:
    """model.chat_template names a Jinja file; the hand-written formats' names are gone."""
    source = checkpoints["qwen2_5"]
    with pytest.raises(UserError) as err:
        overrides = ["model=hf", f"model.source={source}", "model.chat_template=mistral"]
        resolve_model(model_config(overrides))
    assert err.value.key == "model.chat_template" and "Jinja chat template file" in err.value.fix


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_from_a_hub_cache_snapshot(
    family: str, checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf://org/name, offline, through runner.hub and the cache layout huggingface_hub keeps:
    the same model, weights and tokenizer as the plain directory."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    snapshot = write_hub_snapshot(family, tmp_path / "hub", f"acme/tiny-{family}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "model=hf",
                f"model.source=hf://acme/tiny-{family}",
                f"runtime.cache_dir={tmp_path / 'hub'}",
            ],
        )
    recipe = resolve_recipe(cfg, tmp_path / "run")
    plain = resolved(checkpoints[family])
    assert recipe.model.source == str(snapshot)
    assert recipe.model.builder == plain["builder"] and recipe.model.family == plain["family"]
    cached, direct = read_model_state(snapshot), read_model_state(checkpoints[family])
    assert cached.keys() == direct.keys()
    assert all(torch.equal(cached[name], direct[name]) for name in direct)
    chat = messages(CHATS["system, user, assistant"])
    ours = instantiate(recipe.model.tokenizer)
    theirs = instantiate(OmegaConf.create(plain["tokenizer"]))
    assert ours.tokenize_messages(chat) == theirs.tokenize_messages(chat)


def test_a_family_runner_does_not_build_is_a_user_error(tmp_path: Path) -> None:
    source = tmp_path / "gpt2"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (source / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=hf", f"model.source={source}"]))
    assert err.value.key == "model.source" and "gpt2" in err.value.fix
