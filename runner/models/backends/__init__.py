"""The two model backends behind one interface: torchtune's builders, transformers' model classes.

A recipe asks the backend of its model section (`model.backend`, which runner.config.model
decided) for everything that depends on how the model is built, and never branches on its name:

- `build(model, device, dtype)`: the model, with its weights (model.source's, or a random init),
  as an nn.Module called `model(tokens, mask=None, input_pos=None)` that returns logits, or a
  list of logits chunks along the sequence after `set_output_chunks(model, n)` (for
  CEWithChunkedOutputLoss);
- `layers(model)` / `layer_classes(model)`: the decoder layers, which FSDP2 shards one by one
  and activation checkpointing wraps;
- `to_hf(state)` / `read_weights(dir)`: the model's state in Hugging Face names (checkpoints)
  and back;
- LoRA: `build_lora` (of one LoraBuild), `adapter_state`, `adapter_to_peft`, `read_adapter`,
  `peft_config`, `merged_hf_state`; and `meta_model` for counting parameters without weights.

torchtune's backend is the default wherever a runner family (runner/models/families/) builds
the model; any other causal LM that transformers implements goes through transformers' own
class.
"""

from __future__ import annotations

from typing import Any

from runner.models.backends.base import Backend, LoraBuild, set_output_chunks

__all__ = ["BACKENDS", "Backend", "LoraBuild", "backend_for", "set_output_chunks"]

BACKENDS = ("torchtune", "transformers")


def backend_for(model: Any) -> Backend:
    """The backend of a recipe's model section (model.backend)."""
    if model.backend == "transformers":
        from runner.models.backends.transformers import TransformersBackend

        return TransformersBackend(model)
    from runner.models.backends.torchtune import TorchtuneBackend

    return TorchtuneBackend(model)
