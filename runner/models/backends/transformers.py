"""transformers' backend: any causal LM that AutoModelForCausalLM builds (no remote code), in
transformers' own model class, LoRA through peft.

The model is wrapped in CausalLM, which is called as torchtune's decoder is (tokens -> logits,
or logits chunks for CEWithChunkedOutputLoss: the final hidden states are split along the
sequence and each chunk goes through the output projection). Its state names are transformers'
under `hf.`, so checkpoints are the source's own format: the same names, config.json and tied
weights (written once, as save_pretrained writes them). Decoder layers are the modules of the
model's `_no_split_modules` classes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file
from torch import nn

from runner.models.backends.base import Backend, LoraBuild
from runner.rundir import ADAPTER_FILE, check_safetensors, weight_files

if TYPE_CHECKING:  # transformers loads only when a model of this backend is built
    from transformers import PreTrainedModel

PREFIX = "hf."
# The output projection of an attention block, by the names transformers' models give it.
ATTENTION_OUTPUTS = ("o_proj", "out_proj", "dense", "c_proj", "wo")
# torchtune's names of the attention projections (method.lora_attn_modules) -> transformers'.
ATTENTION_INPUTS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj"}
LORA_KEY = re.compile(r"\.(lora_[AB])\.default\.")
PEFT_KEY = re.compile(r"\.(lora_[AB])\.")


class CausalLM(nn.Module):
    """A transformers causal LM (or a peft model of one) called as torchtune's decoder is."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.num_output_chunks = 0

    def set_num_output_chunks(self, num_output_chunks: int) -> None:
        self.num_output_chunks = num_output_chunks

    def causal_lm(self) -> PreTrainedModel:
        """The transformers model (under peft's wrappers, if any)."""
        base_model = getattr(self.hf, "get_base_model", None)
        # peft types get_base_model as returning any nn.Module; it is the model it wraps.
        return cast("PreTrainedModel", self.hf if base_model is None else base_model())

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        if mask is not None or input_pos is not None:
            # runner.config.resolve refuses dataset.packing and padding_free for this backend.
            raise ValueError("the transformers backend takes no packed batches")
        lm = self.causal_lm()
        hidden = lm.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state
        head = lm.get_output_embeddings()
        if self.num_output_chunks == 0:
            return self._finish(head(hidden))
        chunks = hidden.chunk(self.num_output_chunks, dim=1)
        return [self._finish(head(chunk)) for chunk in chunks]

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model's own forward does to the projected logits (Gemma 2's soft cap,
        Granite's and Cohere's scales)."""
        config = self.causal_lm().config
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        scaling = getattr(config, "logits_scaling", None)
        if scaling:
            logits = logits / scaling
        scale = getattr(config, "logit_scale", None)
        if scale:
            logits = logits * scale
        return logits


def from_config(source: str, **dims: Any) -> CausalLM:
    """The model of `source`'s config.json, randomly initialized (on the current device: meta
    for counting). `dims` are its sizes as runner reads them (recorded, for `runner estimate`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=True)
    return CausalLM(AutoModelForCausalLM.from_config(config, trust_remote_code=False))


def _tied(model: nn.Module) -> dict[str, str]:
    """{name of a parameter shared with an earlier one: that one's name} (tied embeddings)."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _projections(module: nn.Module) -> list[str]:
    """Names (under `module`) of its linear projections: nn.Linear and GPT-2's Conv1D."""
    return [
        name
        for name, child in module.named_modules()
        if name and (isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D")
    ]


def _inner(module: nn.Module) -> nn.Module:
    """A layer under activation checkpointing's wrapper."""
    return getattr(module, "_checkpoint_wrapped_module", module)


class TransformersBackend(Backend):
    """AutoModelForCausalLM of model.source, in CausalLM."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.tied: dict[str, str] = {}
        self.targets: list[str] = []

    # ---- the model ----------------------------------------------------------------------
    def _load(self, device: torch.device, dtype: torch.dtype, quantize: bool = False) -> Any:
        from transformers import AutoModelForCausalLM

        source = self.model_cfg.source
        extra: dict[str, Any] = {}
        if quantize:
            from transformers import BitsAndBytesConfig

            extra["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
            extra["device_map"] = {"": device}
        # With output_loading_info, from_pretrained returns (model, info), which its annotation
        # does not say.
        loaded = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            use_safetensors=True,
            trust_remote_code=False,
            local_files_only=True,
            output_loading_info=True,
            **extra,
        )
        model, info = cast(tuple["PreTrainedModel", dict[str, list[str]]], loaded)
        if info["missing_keys"]:
            raise ValueError(f"{source} lacks weights {sorted(info['missing_keys'])[:5]}")
        if quantize:
            # bitsandbytes repacks a 4-bit weight for its CPU inference kernel the first time it
            # runs in eval mode without grad (an evaluation, DPO's reference), for good; that
            # kernel has no backward, so training after it would stop gradients at the base.
            for module in model.modules():
                if hasattr(module, "support_avx512bf16_for_cpu"):
                    setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010
            return model
        # transformers' decorator on PreTrainedModel.to hides that it is a bound method.
        return model.to(device)  # type: ignore[arg-type]

    def build(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        model = CausalLM(self._load(device, dtype))
        self.tied = _tied(model)
        return model

    def _layer_class_names(self, model: nn.Module) -> set[str]:
        lm = model.causal_lm() if isinstance(model, CausalLM) else model
        return set(getattr(lm, "_no_split_modules", None) or ())

    def layers(self, model: nn.Module) -> list[nn.Module]:
        names = self._layer_class_names(model)
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                if all(type(_inner(child)).__name__ in names for child in module):
                    return list(module)
        raise ValueError(f"no list of decoder layers ({', '.join(names)}) in the model")

    def layer_classes(self, model: nn.Module) -> set[type]:
        return {type(_inner(layer)) for layer in self.layers(model)}

    def meta_model(self, lora: dict[str, Any] | None) -> nn.Module:
        with torch.device("meta"):
            model = from_config(self.model_cfg.source)
        if lora is None:
            return model
        from peft import get_peft_model

        with torch.device("meta"):
            lm = model.causal_lm()
            return CausalLM(get_peft_model(lm, self._lora_config(lm, lora)))

    # ---- checkpoints --------------------------------------------------------------------
    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.removeprefix(PREFIX): v for k, v in state.items() if k not in self.tied}

    def read_weights(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for path in weight_files(checkpoint_dir):
            check_safetensors(path, key="checkpoint")
            state.update({PREFIX + k: v for k, v in load_file(str(path)).items()})
        for name, shared in self.tied.items():
            state.setdefault(name, state[shared])
        return state

    # ---- LoRA ---------------------------------------------------------------------------
    def build_lora(self, build: LoraBuild) -> nn.Module:
        from peft import get_peft_model

        # The frozen base in the compute dtype (NF4 with quantize_base, bitsandbytes').
        lm = self._load(build.device, build.compute_dtype, quantize=build.lora["quantize_base"])
        config = self._lora_config(lm, build.lora)
        # The adapters' own init draws from the seed.
        torch.manual_seed(build.seed)
        model = CausalLM(get_peft_model(lm, config))
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(build.dtype)
        self.tied = _tied(model)
        return model

    def _lora_config(self, lm: PreTrainedModel, lora: Mapping[str, Any]) -> Any:
        from peft import LoraConfig

        self.targets = self._lora_targets(lm, lora)
        # GPT-2's Conv1D keeps its weight as (in, out): peft's fan_in_fan_out.
        fan_in_fan_out = any(
            type(m).__name__ == "Conv1D"
            for n, m in lm.named_modules()
            if any(n == t or n.endswith(f".{t}") for t in self.targets)
        )
        return LoraConfig(
            fan_in_fan_out=fan_in_fan_out,
            r=lora["lora_rank"],
            lora_alpha=lora["lora_alpha"],
            lora_dropout=lora["lora_dropout"],
            target_modules=self.targets,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def _lora_targets(self, lm: PreTrainedModel, lora: Mapping[str, Any]) -> list[str]:
        """peft's target_modules (name suffixes) for method.lora_attn_modules, apply_lora_to_mlp
        and apply_lora_to_output. An attention block with fused input projections (GPT-2's
        c_attn) adapts them for any of q_proj, k_proj, v_proj."""
        layer = _inner(self.layers(lm)[0])
        targets: list[str] = []
        for child_name, child in layer.named_children():
            found = _projections(child)
            if "attn" in child_name or "attention" in child_name:
                outputs = [n for n in found if n.rpartition(".")[2] in ATTENTION_OUTPUTS]
                inputs = [n for n in found if n not in outputs]
                for wanted in lora["lora_attn_modules"]:
                    if wanted == "output_proj":
                        names = outputs
                    else:
                        named = [
                            n for n in inputs if n.rpartition(".")[2] == ATTENTION_INPUTS[wanted]
                        ]
                        names = named or inputs
                    targets += [f"{child_name}.{n}" for n in names]
            elif lora["apply_lora_to_mlp"] and child_name in ("mlp", "feed_forward", "ffn"):
                targets += [f"{child_name}.{n}" for n in found]
        if lora["apply_lora_to_output"]:
            head = lm.get_output_embeddings()
            targets += [n for n, m in lm.named_modules() if m is head]
        return sorted(set(targets))

    def adapter_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if ".lora_" in k}

    def adapter_to_peft(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {LORA_KEY.sub(r".\1.", k.removeprefix(PREFIX)): v for k, v in adapter.items()}

    def read_adapter(self, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
        check_safetensors(checkpoint_dir / ADAPTER_FILE, key="checkpoint")
        state = load_file(str(checkpoint_dir / ADAPTER_FILE))
        return {PREFIX + PEFT_KEY.sub(r".\1.default.", k): v for k, v in state.items()}

    def peft_config(self, lora: dict[str, Any], base_dir: str) -> dict[str, Any]:
        with torch.device("meta"):
            lm = from_config(self.model_cfg.source).causal_lm()
        config = self._lora_config(lm, lora).to_dict()
        config["base_model_name_or_path"] = base_dir
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        return json.loads(json.dumps(config, default=str))

    def merged_hf_state(
        self, state: dict[str, torch.Tensor], lora: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """peft's own merge, on a CPU copy of the base with the trained state loaded."""
        from peft import get_peft_model

        lm = self._load(torch.device("cpu"), torch.float32)
        model = get_peft_model(lm, self._lora_config(lm, lora))
        model.load_state_dict({k.removeprefix(PREFIX): v for k, v in state.items()})
        merged = model.merge_and_unload()
        tied = _tied(merged)
        return {k: v.contiguous() for k, v in merged.state_dict().items() if k not in tied}


# Positions of a model whose config.json sets no limit (no position embeddings), for max_seq_len.
UNBOUNDED_POSITIONS = 1 << 20


def transformers_builder(source: Path) -> dict[str, Any]:
    """The recipe's builder node of a transformers model: from_config of `source`, with its
    sizes read through AutoConfig (which maps each architecture's own key names)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=True)
    text = config.get_text_config()
    return {
        "_component_": f"{__name__}.from_config",
        "source": str(source),
        "vocab_size": text.vocab_size,
        "num_layers": text.num_hidden_layers,
        "num_heads": text.num_attention_heads,
        "embed_dim": text.hidden_size,
        "max_seq_len": getattr(text, "max_position_embeddings", None) or UNBOUNDED_POSITIONS,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def check_transformers_weights(source: Path, builder: dict[str, Any]) -> None:
    """A UserError naming model.source unless its safetensors (whole, read from the headers:
    nothing is loaded) hold every weight of its model, tied ones once."""
    from safetensors import safe_open

    from runner.errors import UserError

    names: set[str] = set()
    for path in weight_files(source):
        check_safetensors(path, key="model.source")
        with safe_open(str(path), "pt") as weights:
            names.update(weights.keys())
    with torch.device("meta"):
        lm = from_config(str(source)).causal_lm()
    tied = _tied(lm)
    prefix = f"{lm.base_model_prefix}."
    missing = [
        name
        for name in lm.state_dict()
        if name not in tied and name not in names and name.removeprefix(prefix) not in names
    ]
    if missing:
        raise UserError(
            "model.source",
            str(source),
            f"its weights lack {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} of "
            "the model its config.json describes; re-save the checkpoint with save_pretrained",
        )
