"""merged.quantization=nf4: a merged model whose linear layers transformers loads in 4 bits (NF4,
bitsandbytes), on the CPU; the checkpoints are tests/test_export.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from runner.errors import UserError
from runner.export.write import ExportRequest, export
from tests.test_export import SELECT, logits, make_lora_checkpoint, make_run, token_ids

bitsandbytes = pytest.importorskip("bitsandbytes")  # in the test extra; `quant` for users


def merged(checkpoint: Path, out: Path, quantization: str | None) -> Path:
    """`runner export format=merged merged.quantization=QUANTIZATION out=OUT`, in fp32."""
    return export(
        ExportRequest(
            checkpoint=str(checkpoint),
            select=SELECT,
            format="merged",
            dtype="fp32",
            quantization="f16",
            base=None,
            out=str(out),
            merged_quantization=quantization,
        )
    )


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_nf4_loads_in_4_bits_as_transformers_quantizes(
    kind: str, full_checkpoint: Path, tmp_path: Path
) -> None:
    checkpoint = full_checkpoint
    if kind == "lora":
        checkpoint = make_lora_checkpoint(tmp_path / "lora" / "step_4", full_checkpoint)
    reference = merged(checkpoint, tmp_path / "fp32", None)
    out = merged(checkpoint, tmp_path / "nf4", "nf4")
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu").eval()
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bitsandbytes.nn.Linear4bit) and layer.weight.dtype == torch.uint8
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["bnb_4bit_quant_type"] == "nf4"
    size = (out / "model.safetensors").stat().st_size
    assert size < 0.5 * (Path(reference) / "model.safetensors").stat().st_size
    assert (out / "tokenizer.json").is_file()
    # The file holds what transformers makes of the merged fp32 model quantized as it loads:
    # the same 4-bit weights, so the same logits to the bit.
    on_load = AutoModelForCausalLM.from_pretrained(
        reference,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
        device_map="cpu",
    ).eval()
    for ids in token_ids():
        assert torch.equal(logits(model, ids), logits(on_load, ids))


def test_another_merged_quantization_is_refused_by_name(full_checkpoint: Path, tmp_path: Path):
    with pytest.raises(UserError, match="merged.quantization='int3'.*choose null or one of: nf4"):
        merged(full_checkpoint, tmp_path / "x", "int3")
    assert not (tmp_path / "x").exists()
