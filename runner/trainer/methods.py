"""The training methods: each one a pair of strategies, what trains (runner.trainer.weights) and
what its loss is made of (runner.trainer.objectives), looked up by `recipe.method.name`."""

from __future__ import annotations

from dataclasses import dataclass

from runner.config.method import METHOD_NAMES
from runner.trainer.objectives import Preference, Supervised
from runner.trainer.weights import FullWeights, LoraWeights


@dataclass(frozen=True)
class Method:
    """What trains and how it is saved, and what the loss is made of."""

    weights: type[FullWeights]
    objective: type[Supervised] | type[Preference]


# qlora and qlora_dpo are LoRA whose base the backend quantizes (method.builder.quantize_base).
METHODS = {
    "full": Method(FullWeights, Supervised),
    "lora": Method(LoraWeights, Supervised),
    "qlora": Method(LoraWeights, Supervised),
    "dpo": Method(FullWeights, Preference),
    "lora_dpo": Method(LoraWeights, Preference),
    "qlora_dpo": Method(LoraWeights, Preference),
}
assert tuple(METHODS) == METHOD_NAMES, "runner.config.method names the methods trained here"
