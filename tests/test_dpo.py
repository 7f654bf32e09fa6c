"""method=dpo / lora_dpo: preference tuning on the shipped pairs lifts held-out reward accuracy
above chance, the logged losses are the DPO loss of the saved policy against the saved
reference, resume is exact, two processes train, and bad inputs are refused by name."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.paths import ASSETS_DIR
from tests.cli_forks import Forked, ForkedCli
from tests.conftest import QUICK, deploy_server, losses
from tests.test_resume import straight_then_resumed

PAIRS = ASSETS_DIR / "preference" / "train.jsonl"
STEPS = 20
EVAL_STEPS = 10
BETA = 0.1
# The last 5% of the shipped pairs are held out, so that the test knows which they are.
PREFERENCE = [
    "dataset=preference",
    "dataset.split='train[:95%]'",
    "dataset.validation.held_out=null",
    "dataset.validation.split='train[95%:]'",
]
TRAIN = [
    *QUICK,
    *PREFERENCE,
    f"max_steps={STEPS}",
    "batch_size=8",
    "optimizer.warmup_steps=1",
    "runtime.log_every_n_steps=1",
    f"eval.steps={EVAL_STEPS}",
    f"method.beta={BETA}",
    # The best checkpoint by held-out reward accuracy.
    "objective.metric=eval_rewards_accuracy",
    "objective.mode=max",
]
METHODS = {
    # Every parameter: a checkpoint a step, so that step N's loss can be recomputed from N - 1.
    "dpo": ["method=dpo", "optimizer.lr=1e-3", "runtime.save_every_n_steps=1"],
    # IPO: the loss whose scores are the answers' per-token means (TRL's rule).
    "lora_dpo": ["method=lora_dpo", "optimizer.lr=1e-2", "method.loss=ipo"],
}
LOSS = {"dpo": "sigmoid", "lora_dpo": "ipo"}
# Policy and reference start equal: every reward 0, every pair a tie, the loss log 2 (IPO's the
# square of its target margin).
START = {"dpo": 0.6931472, "lora_dpo": (1 / (2 * BETA)) ** 2}
REWARDS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin")


def train(cli: ForkedCli, run: Path, *overrides: str) -> Forked:
    """`runner train` forked from the suite's warm CLI server (a module fixture's runs)."""
    run.parent.mkdir(parents=True, exist_ok=True)
    return cli(["train", *overrides, f"hydra.run.dir={run}"], run.parent, timeout_s=600)


@pytest.fixture(scope="module")
def runs(forked_cli: ForkedCli, tmp_path_factory) -> dict[str, Path]:
    """A DPO and a LoRA DPO run on the shipped pairs, shared by the tests below."""
    root = tmp_path_factory.mktemp("dpo")
    out = {}
    for name, overrides in METHODS.items():
        result = train(forked_cli, root / name, *TRAIN, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = root / name
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", list(METHODS))
def test_dpo_lifts_held_out_reward_accuracy_above_chance(runs, method: str) -> None:
    run = runs[method]
    steps = [r for r in records(run) if "loss" in r]
    evals = [r for r in records(run) if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert steps[0]["loss"] == pytest.approx(START[method], abs=1e-6)
    assert steps[0]["rewards_accuracy"] == 0.5 and steps[0]["rewards_margin"] == 0
    for record in steps:
        assert set(REWARDS) <= set(record)
    assert [r["step"] for r in evals] == [EVAL_STEPS, STEPS]
    last = evals[-1]
    assert last["eval_rewards_accuracy"] > 0.6, evals  # chance (and the start) is 0.5
    assert last["eval_rewards_margin"] > 0 and last["eval_loss"] < START[method]
    assert last["eval_rewards_chosen"] > last["eval_rewards_rejected"]
    # The best checkpoint is judged by held-out reward accuracy.
    status = json.loads((run / "status.json").read_text())
    best = status["best"]
    assert best["metric"] == "eval_rewards_accuracy" and best["mode"] == "max"
    assert best["value"] == max(r["eval_rewards_accuracy"] for r in evals)
    assert Path(best["checkpoint"]).is_dir()
    # The same metrics in TensorBoard.
    (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    for name in REWARDS:
        assert [s.value for s in board.Scalars(f"train/{name}")] == pytest.approx(
            [r[name] for r in steps], rel=1e-6
        )
        assert [s.value for s in board.Scalars(f"eval/{name}")] == pytest.approx(
            [r[f"eval_{name}"] for r in evals], rel=1e-6
        )


def answer_log_probs(model, tokenizer, prompt: str, answer: str, mean: bool) -> torch.Tensor:
    """log p(answer + end of turn | prompt) under `model`, from the chat template's text (with
    `mean`, per token)."""
    user = {"role": "user", "content": prompt}
    texts = (
        tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False),
        tokenizer.apply_chat_template(
            [user, {"role": "assistant", "content": answer}], tokenize=False
        ),
    )
    asked, whole = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
    assert whole[: len(asked)] == asked
    ids = torch.tensor([whole])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    positions = torch.arange(len(asked), len(whole))
    picked = log_probs[positions - 1, ids[0, positions]]
    return picked.mean() if mean else picked.sum()


def dpo_terms(
    policy, reference, tokenizer, pairs: list[dict], loss: str = "sigmoid"
) -> tuple[float, float]:
    """(mean preference loss, reward accuracy) of `pairs`, computed directly."""
    losses_, correct = [], []
    for pair in pairs:
        logps = [
            answer_log_probs(model, tokenizer, pair["prompt"], pair[side], mean=loss == "ipo")
            for model in (policy, reference)
            for side in ("chosen", "rejected")
        ]
        margin = (logps[0] - logps[1]) - (logps[2] - logps[3])
        if loss == "ipo":
            losses_.append((margin - 1 / (2 * BETA)) ** 2)
        else:
            losses_.append(-F.logsigmoid(BETA * margin))
        correct.append(float(logps[0] - logps[2] > logps[1] - logps[3]))
    return float(torch.stack(losses_).mean()), sum(correct) / len(correct)


def load(method: str, run: Path, step: int):
    """(policy, reference) of a run's checkpoint at `step`, loaded by transformers (and peft)."""
    checkpoint = run / "checkpoints" / f"step_{step}"
    base, policy = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for path in (run / "base_model", run / "base_model" if method == "lora_dpo" else checkpoint)
    )
    if method == "lora_dpo":  # peft adds the adapter to the model it is given
        policy = PeftModel.from_pretrained(policy, checkpoint)
    return policy.eval(), base.eval()


@pytest.mark.parametrize("method", list(METHODS))
def test_logged_dpo_loss_is_the_direct_computation(runs, method: str) -> None:
    run = runs[method]
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    trained = round(len(pairs) * 0.95)
    held_out = pairs[trained:][:64]  # eval.max_samples=64 (QUICK)
    tokenizer = AutoTokenizer.from_pretrained(run / "base_model")
    # The held-out loss at the last step: the saved policy against the saved reference. The
    # direct computation sums in float64, the run in float32: 1e-5 covers the difference.
    policy, reference = load(method, run, STEPS)
    loss, accuracy = dpo_terms(policy, reference, tokenizer, held_out, LOSS[method])
    last = records(run)[-1]
    assert last["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert last["eval_rewards_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    if method != "dpo":
        return
    # A training step's loss: step STEPS's batch (the sampler's order with seed 0) under the
    # weights saved at the step before.
    sampler = torch.utils.data.DistributedSampler(range(trained), num_replicas=1, rank=0, seed=0)
    batch = [pairs[i] for i in list(sampler)[(STEPS - 1) * 8 : STEPS * 8]]
    policy, reference = load(method, run, STEPS - 1)
    loss, _ = dpo_terms(policy, reference, tokenizer, batch)
    assert losses(run)[STEPS] == pytest.approx(loss, abs=1e-5)


def test_dpo_checkpoints_export_and_deploy_as_sft_ones(
    runs, runner_cli, hermetic_env, tmp_path: Path
) -> None:
    # The LoRA DPO adapter, merged by `runner export`, gives the adapter's logits.
    merged = tmp_path / "merged"
    run = runs["lora_dpo"]
    best = json.loads((run / "status.json").read_text())["best"]
    result = runner_cli("export", f"checkpoint={best['checkpoint']}", f"out={merged}")
    assert result.returncode == 0, result.stderr[-3000:]
    policy, _ = load("lora_dpo", run, best["step"])
    exported = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"Upper:\nabc")])
    with torch.no_grad():
        # fp32 merge of B @ A into W reorders the sums: equal within 1e-4.
        torch.testing.assert_close(exported(ids).logits, policy(ids).logits, atol=1e-4, rtol=0)
    # The full DPO run's best checkpoint answers through `runner deploy`.
    served = [f"checkpoint={runs['dpo']}", "select.checkpoint=best", "served_model_name=[dpo]"]
    served += ["device=cpu", "dtype=fp32"]
    with deploy_server(served, cwd=tmp_path, env=hermetic_env, up_within_s=300) as url:
        messages = [{"role": "user", "content": "Upper:\nabc"}]
        body = {"model": "dpo", "messages": messages, "max_tokens": 4}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as response:
            answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["role"] == "assistant"


# Trained twice over (straight, then stopped and resumed): LoRA's in `pytest -m long`.
@pytest.mark.parametrize("method", ["dpo", pytest.param("lora_dpo", marks=pytest.mark.long)])
def test_dpo_resume_gives_identical_losses(runner_cli, tmp_path: Path, method: str) -> None:
    extra = ["method.dropout=0.1"] if method == "lora_dpo" else []
    straight, resumed = straight_then_resumed(
        runner_cli, tmp_path, f"method={method}", *PREFERENCE, *extra, n=3
    )
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == straight  # exact float equality, step by step


@pytest.mark.parametrize("method", list(METHODS))
def test_dpo_trains_in_two_processes(runner_cli, tmp_path: Path, method: str) -> None:
    run = tmp_path / "run"
    result = runner_cli(
        "train",
        *TRAIN,
        *METHODS[method],
        "compute.nproc_per_node=2",
        "max_steps=4",
        "eval.steps=2",
        "batch_size=4",
        f"hydra.run.dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(run)
    assert sorted(curve) == [1, 2, 3, 4]
    assert curve[1] == pytest.approx(START[method], abs=1e-5)
    assert curve[4] < curve[1]
    evals = [r for r in records(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert (run / "checkpoints" / "step_4" / "training_state.pt").is_file()


def test_ultrafeedback_layout_reads_conversations(runner_cli, tmp_path: Path) -> None:
    """The hub layout: data/{train,test}_prefs-*.parquet, chosen and rejected conversations."""
    data = tmp_path / "ultrafeedback" / "data"
    data.mkdir(parents=True)
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()[:40]]

    def conversation(pair: dict, side: str) -> list[dict]:
        return [
            {"role": "user", "content": pair["prompt"]},
            {"role": "assistant", "content": pair[side]},
        ]

    table = pa.table(
        {
            "prompt": [p["prompt"] for p in pairs],
            "chosen": [conversation(p, "chosen") for p in pairs],
            "rejected": [conversation(p, "rejected") for p in pairs],
        }
    )
    pq.write_table(table.slice(0, 32), data / "train_prefs-00000-of-00001.parquet")
    pq.write_table(table.slice(32), data / "test_prefs-00000-of-00001.parquet")
    result = runner_cli(
        "validate",
        "compute=cpu",
        "method=lora_dpo",
        "dataset=ultrafeedback",
        f"dataset.source={data.parent}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[train_prefs] (32 records)" in result.stdout
    assert "[test_prefs] (8 records)" in result.stdout


def test_loss_variants_match_torchtunes_and_their_formulas() -> None:
    from torchtune.rlhf.loss import DPOLoss, RSOLoss

    from runner.trainer.objectives import preference_loss

    logps = [torch.randn(16, generator=torch.Generator().manual_seed(i)) * 5 for i in range(4)]
    margin = (logps[0] - logps[1]) - (logps[2] - logps[3])
    for smoothing in (0.0, 0.2):
        ours = preference_loss(*logps, loss="sigmoid", beta=0.3, label_smoothing=smoothing)
        theirs = DPOLoss(beta=0.3, label_smoothing=smoothing)(*logps)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    ours = preference_loss(*logps, loss="hinge", beta=0.3, label_smoothing=0.0)
    for a, b in zip(ours, RSOLoss(gamma=0.3)(*logps), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ipo, _, _ = preference_loss(*logps, loss="ipo", beta=0.3, label_smoothing=0.0)
    torch.testing.assert_close(ipo, (margin - 1 / 0.6) ** 2)


def test_ipo_scores_an_answer_by_its_mean_token_log_probability() -> None:
    """TRL's rule (DPOTrainer.concatenated_forward divides by the answer's length for ipo):
    summed, the margin of long answers outgrew IPO's target 1/(2 beta), which is length-free."""
    from runner.data import answer_log_probs

    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6], [-100, 1, -100, -100, -100, -100]])
    per_token = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    scored = labels != -100
    sums = (per_token * scored).sum(-1)
    torch.testing.assert_close(answer_log_probs(logits, labels), sums)
    torch.testing.assert_close(answer_log_probs(logits, labels, mean=True), sums / scored.sum(-1))


def user_error(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr


def test_bad_preference_inputs_are_refused_by_name(runner_cli, tmp_path: Path) -> None:
    quick = ["compute=cpu", "dtype=fp32"]
    # Instruction data with a preference method, and the reverse.
    message = user_error(runner_cli("validate", *quick, "method=dpo"))
    assert "method=dpo trains on preference pairs" in message and "dataset=preference" in message
    message = user_error(runner_cli("validate", *quick, "dataset=preference"))
    assert "method=dpo, lora_dpo or qlora_dpo" in message
    # A file without the chosen column.
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(
        "".join(
            json.dumps({"prompt": "Upper:\nab", "better": "AB", "rejected": "ab"}) + "\n"
            for _ in range(40)
        )
    )
    message = user_error(
        runner_cli("validate", *quick, "method=dpo", "dataset=preference", f"dataset.source={bad}")
    )
    assert "dataset.column_map.chosen" in message and "has no column 'chosen'" in message
    # beta must be positive; the loss is one of the known ones; smoothing only for sigmoid.
    for override, key in (
        ("method.beta=0", "method.beta"),
        ("method.beta=-0.5", "method.beta"),
        ("method.loss=kto", "method.loss"),
        ("method.label_smoothing=0.7", "method.label_smoothing"),
        ("dataset.max_forward_tokens=512", "dataset.max_forward_tokens"),
    ):
        message = user_error(
            runner_cli("validate", *quick, "method=dpo", "dataset=preference", override)
        )
        assert key in message, message
    # A conversation that does not end in the answer, named by file, row and column.
    odd = tmp_path / "odd.jsonl"
    rows = [{"chosen": [{"role": "user", "content": "hi"}], "rejected": "x", "prompt": "hi"}]
    odd.write_text("".join(json.dumps(r) + "\n" for r in rows * 40))
    message = user_error(
        runner_cli("validate", *quick, "method=dpo", "dataset=preference", f"dataset.source={odd}")
    )
    assert "row 1, column 'chosen'" in message and "assistant" in message
    # Two answers to two prompts (a mis-joined file) are no pair: named at its row.
    mixed = tmp_path / "mixed.jsonl"
    pair = {
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "rejected": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "no"}],
    }
    mixed.write_text((json.dumps(pair) + "\n") * 40)
    message = user_error(
        runner_cli(
            "validate",
            *quick,
            "method=dpo",
            "dataset=preference",
            "dataset.column_map.prompt=null",
            f"dataset.source={mixed}",
        )
    )
    assert "row 1, column 'rejected'" in message, message
    assert "differs from the chosen one's" in message, message
    # Pairs with one answer on both sides train nothing: validate counts them, in a warning.
    same = tmp_path / "same.jsonl"
    rows = [
        {"prompt": "hi", "chosen": "yo", "rejected": "yo" if i % 4 == 0 else "no"}
        for i in range(40)
    ]
    same.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner_cli(
        "validate", *quick, "method=dpo", "dataset=preference", f"dataset.source={same}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{same}: 10 of 40 pairs have one answer as both chosen and rejected" in result.stderr
    # A prompt that fills dataset.max_seq_len leaves no answer token to score.
    message = user_error(
        runner_cli("validate", *quick, "method=dpo", "dataset=preference", "dataset.max_seq_len=20")
    )
    assert "dataset.max_seq_len=20" in message and "no token of the answer is left" in message


def test_a_data_warning_is_said_at_launch_not_again_in_training(tmp_path: Path, caplog) -> None:
    """The launcher's check says what it finds in the data; the training process reads the data
    again: a pair with one answer as both was warned of twice, 0.3 s apart."""
    import logging

    from runner.data import check_datasets, said_at_launch, training_splits
    from tests.test_data import data, tokenizer

    same = tmp_path / "same.jsonl"
    rows = [{"prompt": "hi", "chosen": "yo", "rejected": "yo" if i else "no"} for i in range(8)]
    same.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = data(
        "dataset=preference", f"dataset.source={same}", "dataset.validation.held_out=null"
    )
    with caplog.at_level(logging.WARNING):
        check_datasets(section, tokenizer())
        with said_at_launch():
            training_splits(section, tokenizer(), validation=True)
    warned = [
        r.getMessage() for r in caplog.records if "both chosen and rejected" in r.getMessage()
    ]
    assert warned == [
        f"{same}: 7 of 8 pairs have one answer as both chosen and rejected, which "
        "train nothing (their DPO gradient is zero)"
    ]


def test_preference_pairs_pass_the_chat_templates_checks_before_training(tmp_path: Path) -> None:
    """Gemma 2's template refuses a system message: a pair holding one passed runner validate,
    and failed the run when training drew it, naming no row. Text parts, which a pair's
    messages do not take, passed as text (a mixed column is read as JSON text) and failed
    training with a traceback."""
    from runner.data import DataError, check_datasets
    from runner.models.tokenizer import ChatTokenizer
    from tests.fixtures import write_family_tokenizer
    from tests.test_data import data, tokenizer

    def pair(system: bool, parts: bool = False) -> dict:
        asked = [{"type": "text", "text": "q"}] if parts else "q"
        first = [{"role": "system", "content": "Be brief."}] if system else []
        prompt = [*first, {"role": "user", "content": asked}]
        answer = [{"role": "assistant", "content": "good"}]
        return {"chosen": prompt + answer, "rejected": [*prompt, {**answer[0], "content": "no"}]}

    write_family_tokenizer("gemma2", tmp_path / "gemma2")
    with_system = tmp_path / "system.jsonl"
    with_system.write_text("".join(json.dumps(pair(i == 3)) + "\n" for i in range(8)))
    section = [
        "dataset=preference",
        "dataset.column_map.prompt=null",
        "dataset.validation.held_out=null",
    ]
    with pytest.raises(DataError) as refused:
        check_datasets(
            data(*section, f"dataset.source={with_system}"),
            ChatTokenizer(str(tmp_path / "gemma2")),
        )
    assert (refused.value.row, refused.value.column) == (4, "chosen")
    assert "System role not supported" in str(refused.value)
    with_parts = tmp_path / "parts.jsonl"
    with_parts.write_text("".join(json.dumps(pair(False, i == 5)) + "\n" for i in range(8)))
    with pytest.raises(DataError) as refused:
        check_datasets(data(*section, f"dataset.source={with_parts}"), tokenizer())
    assert refused.value.row == 6 and "is a list" in str(refused.value)
