"""`runner deploy` serves what `runner train` wrote: the real CLI, server and OpenAI client."""

from __future__ import annotations

from pathlib import Path

import openai
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.components import instantiate
from runner.models.torchtune_boundary import Message
from tests.conftest import QUICK, deploy_server


def test_deploy_serves_a_checkpoint_the_suite_trains(runner_cli, hermetic_env, tmp_path) -> None:
    run = tmp_path / "outputs" / "run"
    trained = runner_cli(
        "train", *QUICK, "max_steps=40", "dataset.eval_samples=0", f"hydra.run.dir={run}"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    # The reference below is transformers' fp32 generate on the CPU.
    served = [f"checkpoint={run}", "served_model_name=[tiny]", "device=cpu", "dtype=fp32"]
    with deploy_server(served, cwd=tmp_path, env=hermetic_env, up_within_s=300) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        messages = [{"role": "user", "content": "Reverse the word.\nlemon"}]
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0
        )
        checkpoint = Path(run) / "checkpoints" / "step_40"
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, use_safetensors=True).eval()
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :]
        assert chat.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)
        assert chat.usage.prompt_tokens == ids.shape[1]
        # The prompt served is the one training rendered: the same template, the same ids.
        trained_with = instantiate(OmegaConf.load(run / "recipe.yaml").model.tokenizer)
        prompt = [Message(role=m["role"], content=m["content"]) for m in messages]
        assert trained_with.generation_prompt(prompt) == ids[0].tolist()
