"""Model families: tiny real checkpoints of each, written by transformers, through our code.

For each family: the recipe's model gives transformers' logits, our tokenizer path gives
transformers' ids (chat template included), and `runner train model=hf model.source=DIR` trains
it into a checkpoint transformers loads; as hf://org/name it loads from a hub cache snapshot.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from runner.components import instantiate
from runner.config.dataset import check_packing
from runner.config.model import _backend, resolve_model
from runner.config.resolve import resolve_recipe
from runner.deploy.loading import load_checkpoint
from runner.errors import UserError
from runner.models.checkpoint import (
    read_adapter_state,
    read_model_state,
    write_lora_checkpoint,
)
from runner.models.families import (
    builder_args,
    check_source_matches,
    family_named,
    hf_config,
    peft_config,
    read_config,
    tune_to_hf,
    tune_to_peft,
)
from runner.models.families.llama3 import LLAMA3_ROPE
from runner.models.torchtune_boundary import Message, peft_adapter_config
from runner.paths import CONF_DIR
from tests.conftest import greedy_texts, losses, transformers_warnings
from tests.fixtures import (
    FAMILIES,
    FAMILY_OF,
    NO_SYSTEM_ROLE,
    write_hub_snapshot,
    write_tiny_checkpoint,
)

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


def train_source(runner_cli, source: Path, run_dir: Path, *overrides: str) -> None:
    """`runner train model=hf model.source=SOURCE` on the CPU into `run_dir`, which succeeds."""
    result = runner_cli(
        "train",
        "model=hf",
        f"model.source={source}",
        "compute=cpu",
        "runtime.progress_bar=false",
        "runtime.loggers=[]",
        *overrides,
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]


@functools.cache
def resolved(source: Path) -> dict:
    """model=hf's recipe model section for a source."""
    return asdict(resolve_model(model_config(["model=hf", f"model.source={source}"])))


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_model_gives_transformers_logits(checkpoints: dict[str, Path], family: str) -> None:
    source = checkpoints[family]
    assert resolved(source)["family"] == FAMILY_OF[family]
    ours = instantiate(OmegaConf.create(resolved(source)["builder"]))
    ours.load_state_dict(read_model_state(source))
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5", "gemma", "gemma2"])
def test_an_adapter_in_peft_gives_the_lora_models_logits(checkpoints, family: str) -> None:
    """Adapter names and layouts per family: Llama's and Gemma's q/k rows are permuted, Qwen2's
    are not."""
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


@pytest.mark.parametrize("family", ["phi3", "phi4"])
def test_adapters_of_fused_projections_load_in_peft(checkpoints, family: str, tmp_path) -> None:
    """Phi-3's Hugging Face model fuses q/k/v (qkv_proj) and gate/up (gate_up_proj): the LoRA
    checkpoint adapts the fused modules (k not adapted: its rows' update is zero), peft loads it
    onto transformers' model with the LoRA model's logits, and it reads back unchanged."""
    source = checkpoints[family]
    lora = {
        "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
        "apply_lora_to_mlp": True,
        "apply_lora_to_output": True,
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
    }
    recipe = resolved(source)
    ours = instantiate(
        OmegaConf.create({**recipe["builder"], "_component_": recipe["lora_builder"], **lora})
    )
    ours.load_state_dict(read_model_state(source), strict=False)
    torch.manual_seed(0)
    # Adapters as large as the weights (std 0.1), not N(0, 1) on every projection: logits in the
    # hundreds would put fp32 rounding of the fused and split matmuls above 1e-4.
    adapter = {
        name: 0.1 * torch.randn_like(t) for name, t in ours.state_dict().items() if "lora" in name
    }
    ours.load_state_dict(adapter, strict=False)
    hf_config = read_config(source)
    write_lora_checkpoint(
        tmp_path / "step_1",
        adapter_state=tune_to_peft(adapter, hf_config),
        adapter_config=peft_config(peft_adapter_config(lora, str(source)), hf_config),
        hf_config=hf_config,
        tokenizer_dir=source,
        training_state={},
        stop_token_ids=[0],
        merged_state=None,
    )
    config = json.loads((tmp_path / "step_1" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == [
        "down_proj", "gate_up_proj", "lm_head", "o_proj", "qkv_proj"
    ]  # fmt: skip
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(theirs, tmp_path / "step_1")
    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff
    back = read_adapter_state(tmp_path / "step_1", hf_config)
    assert back.keys() == adapter.keys()
    assert all(torch.equal(back[name], adapter[name]) for name in adapter)


def chats(
    examples: dict[str, list[tuple[str, str]]], family: str
) -> dict[str, list[tuple[str, str]]]:
    """The examples a family's chat template renders: Gemma's refuses a system message."""
    if family not in NO_SYSTEM_ROLE:
        return examples
    return {name: chat for name, chat in examples.items() if chat[0][0] != "system"}


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
    for name, chat in chats(CHATS, family).items():
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
        # Each answer ends with its end-of-turn token (Gemma's <end_of_turn>, Phi-3's <|end|>).
        assert all(r[-1] in ours.stop_tokens for r in runs), name
    for name, chat in chats(PROMPTS, family).items():
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


@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5", "mistral", "gemma2", "phi3", "smollm2"])
def test_runner_trains_a_source_of_each_family(
    checkpoints: dict[str, Path], family: str, runner_cli, tmp_path: Path
) -> None:
    source, run_dir = checkpoints[family], tmp_path / "run"
    train_source(
        runner_cli,
        source,
        run_dir,
        "max_steps=2",
        "batch_size=2",
        "dataset.eval_samples=2",
        "runtime.log_every_n_steps=1",
    )
    assert sorted(losses(run_dir)) == [1, 2]
    checkpoint = run_dir / "checkpoints" / "step_2"
    # Saved in the format loaded: the source's config.json and tokenizer files, HF names.
    config = json.loads((checkpoint / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "dtype"} == {
        k: v for k, v in original.items() if k != "dtype"
    }
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_bytes() == (source / name).read_bytes(), name
    # The source's generation config, its eos joined by the tokens the run's evaluation stops at.
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    own = json.loads((source / "generation_config.json").read_text())
    eos = own["eos_token_id"] if isinstance(own["eos_token_id"], list) else [own["eos_token_id"]]
    stops = instantiate(OmegaConf.load(run_dir / "recipe.yaml").model.tokenizer).stop_tokens
    assert generation == {**own, "eos_token_id": [*eos, *(t for t in stops if t not in eos)]}
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
    prompt = PROMPTS["user" if family in NO_SYSTEM_ROLE else "system, user"]
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


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_chat_fine_tune_of_a_base_model_is_served_to_stop_where_it_learnt_to(
    checkpoints: dict[str, Path], runner_cli, tmp_path: Path, method: str
) -> None:
    """A base model's eos is its end of text (<|end_of_text|>), and its chat template ends each
    answer with <|eot_id|>, which trains: its checkpoint kept the base's generation config, and
    the served model answered to max_tokens (finish_reason "length") after its answer; a LoRA
    adapter's too, served on its base, whose generation config is the base's."""
    source = tmp_path / "base"
    shutil.copytree(checkpoints["llama3_2"], source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    end_of_text = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    for name, key, value in [
        ("tokenizer_config.json", "eos_token", "<|end_of_text|>"),
        ("generation_config.json", "eos_token_id", end_of_text),
    ]:
        written = json.loads((source / name).read_text())
        (source / name).write_text(json.dumps({**written, key: value}))
    chats = tmp_path / "chats.jsonl"
    chat = [
        {"role": role, "content": text} for role, text in CHATS["user, assistant, user, assistant"]
    ]
    chats.write_text(json.dumps({"messages": chat}) + "\n")
    run_dir = tmp_path / "run"
    train_source(
        runner_cli,
        source,
        run_dir,
        f"method={method}",
        "dataset=chat",
        f"dataset.source={chats}",
        "dtype=fp32",
        "max_steps=1",
        "batch_size=1",
        "dataset.eval_samples=0",
    )
    checkpoint = run_dir / "checkpoints" / "step_1"
    served = load_checkpoint(checkpoint, device="cpu", dtype="fp32", max_model_len=None)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert {end_of_text, end_of_turn} <= served.eos_token_ids


@pytest.mark.parametrize(
    "family,method", [("gemma2", "lora"), ("phi3", "lora"), ("gemma", "qlora"), ("phi3", "qlora")]
)
def test_runner_fine_tunes_adapters_of_the_new_families(
    family: str, method: str, runner_cli, tmp_path: Path
) -> None:
    """LoRA and QLoRA (width 256: every projection whole NF4 blocks of 64 x 256) train, and
    the adapter peft loads onto transformers' model gives the recipe's logits (LoRA) or differs
    from the base (QLoRA, whose base the recipe holds in NF4)."""
    source = write_tiny_checkpoint(family, tmp_path / family, width=256)
    run_dir = tmp_path / "run"
    train_source(
        runner_cli,
        source,
        run_dir,
        f"method={method}",
        "method.apply_lora_to_mlp=true",
        "dtype=fp32",
        "max_steps=2",
        "batch_size=2",
        "dataset.eval_samples=2",
    )
    checkpoint = run_dir / "checkpoints" / "step_2"
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(tokens).logits
        theirs = PeftModel.from_pretrained(base, checkpoint)(tokens).logits
    assert (theirs - before).abs().max().item() > 1e-4  # it trained
    if method == "lora":
        recipe = OmegaConf.load(run_dir / "recipe.yaml")
        ours = instantiate(OmegaConf.merge(recipe.model.builder, recipe.method.builder))
        ours.load_state_dict(read_model_state(source), strict=False)
        ours.load_state_dict(read_adapter_state(checkpoint, read_config(source)), strict=False)
        with torch.no_grad():
            assert (ours(tokens) - theirs).abs().max().item() <= 1e-4


SMALL = {
    "vocab_size": 96,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 512,
}
# family -> its builder's arguments beyond SMALL (model.source=null: a random-init model).
RANDOM_INIT = {
    "llama3": {"scale_factor": 32, "tie_word_embeddings": True},
    "qwen2": {"tie_word_embeddings": False},
    "mistral": {},
    "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "sliding_window_size": 8, "query_pre_attn_scalar": 24},
    "phi3": {"rope_base": 250000},
}


@pytest.mark.long  # compiles
def test_the_cuda_paths_compiled_step_serves_gemma2_as_eager(checkpoints) -> None:
    # compute=cpu, dtype=fp32. The CUDA path's step (padded, compiled by layer: one compiled
    # decoder layer serves every layer, its index symbolic) on the family whose layers differ
    # most: sliding-window and global attention in turn, soft-capped scores. Three graphs, none
    # broken, and the eager engine's greedy answers (the other families: a scratch run, the same).
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runner.deploy.engine import TransformersEngine

    prompts = [[5 + i] * (4 + 3 * i) for i in range(4)]
    said = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        # A model each: compiling by layer compiles the model's layers in place.
        loaded = load_checkpoint(
            checkpoints["gemma2"], device="cpu", dtype="fp32", max_model_len=None
        )
        engine = TransformersEngine(
            loaded, max_batch_size=4, max_queue=8, cuda_graphs=False, padded=True, compile=compiled
        )
        try:
            said[compiled] = greedy_texts(engine, prompts, 8)
        finally:
            engine.close()
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert said[True] == said[False]


def test_a_llama3_config_json_of_a_short_context_loads_quietly_and_rotates_the_same() -> None:
    """model=tiny's context, 8192, is Llama 3's original one, which transformers warns about at
    every load of the published keys; the config.json written halves them together instead:
    no warning, and transformers' RoPE frequencies the same as the published keys', bit for bit
    (torchtune's are the builder's; the test above compares the logits)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    builder = OmegaConf.to_container(model_config(["model=tiny"]).builder)
    written = hf_config(
        family_named("llama3"), builder, initializer_range=0.02, bos_token_id=1, eos_token_id=2
    )
    published = {**written, "rope_scaling": {**written["rope_scaling"], **LLAMA3_ROPE}}
    assert written["max_position_embeddings"] == 8192
    with transformers_warnings() as warned:
        config = AutoConfig.for_model(**written)
    assert not warned, warned
    with transformers_warnings() as warned:
        published_config = AutoConfig.for_model(**published)
    assert any("original_max_position_embeddings" in message for message in warned), warned
    frequencies = ROPE_INIT_FUNCTIONS["llama3"]
    assert torch.equal(frequencies(config, "cpu")[0], frequencies(published_config, "cpu")[0])
    # Read back, the written config.json is the builder's model (raises if not).
    family = family_named("llama3")
    check_source_matches(family, builder, builder_args(family, written, ""), "config.json")


@pytest.mark.parametrize("family", sorted(RANDOM_INIT))
def test_a_random_init_model_is_saved_as_the_same_transformers_model(family: str) -> None:
    """The config.json written for a builder (hf_config) and the weights in Hugging Face's
    names and layouts (tune_to_hf) are a transformers model with the builder's logits."""
    builder = {"_component_": family_named(family).builder, **SMALL, **RANDOM_INIT[family]}
    config = hf_config(
        family_named(family), builder, initializer_range=0.02, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    ours = instantiate(OmegaConf.create(builder))
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.normal_(0, 0.2)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    missing, unexpected = theirs.load_state_dict(
        tune_to_hf(ours.state_dict(), config), strict=False
    )
    # A tied output projection is the embeddings' own weight: not saved.
    assert not unexpected and set(missing) <= (
        {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    )
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


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
    """hf://org/name, offline, through runner.hub.download and the cache layout huggingface_hub
    keeps: the same model, weights and tokenizer as the plain directory."""
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
    chat = messages(CHATS["user, assistant, user, assistant"])
    ours = instantiate(recipe.model.tokenizer)
    theirs = instantiate(OmegaConf.create(plain["tokenizer"]))
    assert ours.tokenize_messages(chat) == theirs.tokenize_messages(chat)


@pytest.mark.parametrize(
    "family,edit,named",
    [
        # transformers' Gemma 2 reads "gelu" as the exact GELU; torchtune's MLP is gelu-tanh.
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation=gelu"),
        ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
        ("gemma", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "phi3",
            {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}},
            "longrope",
        ),
    ],
)
def test_a_setting_torchtune_does_not_build_goes_to_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, family: str, edit: dict, named: str
) -> None:
    """model.backend=auto trains it through transformers' own class, naming the setting as its
    reason; model.backend=torchtune is refused naming it."""
    source = tmp_path / family
    shutil.copytree(checkpoints[family], source)
    config = json.loads((source / "config.json").read_text())
    config.pop("rope_parameters", None)  # transformers 5 keeps RoPE settings here too
    (source / "config.json").write_text(json.dumps({**config, **edit, "rope_theta": 10000.0}))
    with pytest.raises(UserError) as err:
        resolve_model(
            model_config(["model=hf", f"model.source={source}", "model.backend=torchtune"])
        )
    assert err.value.key == "model.backend" and named in err.value.fix, err.value.fix
    assert "model.backend=auto trains it through transformers'" in err.value.fix
    # The choice alone: edited so, some of these are no loadable checkpoint (gemma's untied
    # head has no weights here), which transformers' loading says in its own words.
    written = json.loads((source / "config.json").read_text())
    backend, reason = _backend(model_config(["model=hf", f"model.source={source}"]), written)
    assert backend == "transformers" and named in reason, reason


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_sliding_window_ends_the_sequences_where_the_model_is_exact(
    checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """torchtune's mistral and phi3 attend to the whole sequence: the windowed model's equal up
    to the window, where the recipe's sequences end."""
    source = tmp_path / family
    shutil.copytree(checkpoints[family], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    with pytest.warns(UserWarning, match="truncated to sliding_window=16"):
        recipe = asdict(resolve_model(model_config(["model=hf", f"model.source={source}"])))
    assert recipe["builder"]["max_seq_len"] == recipe["tokenizer"]["max_seq_len"] == 16
    ours = instantiate(OmegaConf.create(recipe["builder"]))
    ours.load_state_dict(read_model_state(source))
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4


def test_a_family_runner_does_not_build_is_a_user_error(tmp_path: Path) -> None:
    source = tmp_path / "gpt2"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (source / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as err:
        resolve_model(model_config(["model=hf", f"model.source={source}"]))
    assert err.value.key == "model.source" and "t5" in err.value.fix


@pytest.mark.parametrize("family", FAMILIES)
def test_deploy_answers_as_transformers_generate_does(
    checkpoints: dict[str, Path], family: str
) -> None:
    """`runner deploy`'s engine, two prompts of different lengths decoded in one batch past
    Gemma 2's 8-token window, gives each the greedy continuation transformers' generate gives
    it alone."""
    import asyncio

    from runner.deploy.engine import TransformersEngine
    from runner.deploy.generation import SamplingRequest
    from runner.deploy.kv_cache import check_supported

    loaded = load_checkpoint(checkpoints[family], device="cpu", dtype="fp32", max_model_len=None)
    check_supported(loaded.model)
    vocab = loaded.model.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (length,), generator=generator) for length in (13, 5)]
    engine = TransformersEngine(loaded, max_batch_size=4, max_queue=4)

    async def served() -> list[tuple[str, int]]:
        handles = [
            engine.submit([SamplingRequest(p.tolist(), 20, 0.0, 1.0, 0, [], 1, stream=False)])
            for p in prompts
        ]
        finals = [[event async for event in handle.events()][-1] for handle in handles]
        return [(event.text, event.completion_tokens) for event in finals]

    try:
        answers = asyncio.run(served())
    finally:
        engine.close()
    for prompt, (text, count) in zip(prompts, answers, strict=True):
        stops = sorted(loaded.eos_token_ids)
        with torch.no_grad():
            output = loaded.model.generate(
                prompt[None],
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=stops[0],
            )
        new = output[0, len(prompt) :].tolist()
        assert count == len(new)
        ended = new[:-1] if new[-1] in loaded.eos_token_ids else new
        assert text == loaded.tokenizer.decode(ended, skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_the_output_projection_builds_where_untied_and_is_refused_where_tied(
    checkpoints: dict[str, Path], family: str, tmp_path: Path
) -> None:
    """method.apply_lora_to_output: refused before launch, naming the key, where the output
    projection is the embeddings (Gemma's always); built by the family's LoRA twin elsewhere
    (Llama 3.2's builder untied included, which torchtune's lora_llama3_2 refuses)."""
    source = checkpoints[family]
    overrides = ["compute=cpu", "model=hf", f"model.source={source}", "method=lora"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "method.apply_lora_to_output=true"])
    tied = read_config(source)["tie_word_embeddings"]
    if tied:
        with pytest.raises(UserError) as err:
            resolve_recipe(cfg, tmp_path / "run")
        assert err.value.key == "method.apply_lora_to_output"
        assert "ties its output projection" in err.value.fix
        cfg.method.apply_lora_to_output = False
    recipe = resolve_recipe(cfg, tmp_path / "run")
    with torch.device("meta"):
        full = instantiate(recipe.model.builder)
        lora = instantiate(OmegaConf.merge(recipe.model.builder, recipe.method.builder))
    # The LoRA model ties as the full model does: the same base weights, the adapters beside.
    base = {name for name in lora.state_dict() if ".lora_" not in name}
    assert base == set(full.state_dict()), base ^ set(full.state_dict())
    assert hasattr(lora.output, "lora_a") != tied, type(lora.output)


def test_packing_gemma2_on_a_gpu_is_refused_before_launch(checkpoints: dict[str, Path]) -> None:
    """Packs on a GPU get flex attention's block mask, on which torchtune's Gemma 2 attention
    raises NotImplementedError mid-training; refused by name instead (CPU packs: a dense mask)."""
    gemma2 = resolve_model(model_config(["model=hf", f"model.source={checkpoints['gemma2']}"]))
    with pytest.raises(UserError) as err:
        check_packing(True, gemma2, "cuda")
    assert err.value.key == "dataset.packing" and "dataset.packing=false" in err.value.fix
    check_packing(True, gemma2, "cpu")
    check_packing(False, gemma2, "cuda")
    llama = resolve_model(model_config(["model=hf", f"model.source={checkpoints['llama3_1']}"]))
    check_packing(True, llama, "cuda")
