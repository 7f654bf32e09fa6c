"""lm-evaluation-harness scoring through `runner deploy`, beside its own transformers backend.

    pip install 'lm-eval[api]'   # not one of runner's dependencies
    python scripts/serving/lm_eval_check.py [--checkpoint DIR] [--add-bos-token]

Serves the checkpoint (without one: bench_deploy.py's tiny model, random weights) with `runner
deploy` on the CPU in fp32, and asks lm-eval's `local-completions` model (LocalCompletionsAPI:
token ids, echo, logprobs 1, max_tokens 1) and its `hf` model (HFLM, the same checkpoint in this
process) for the log-likelihood of each continuation below; prints both and the largest
difference. The two tokenize alike only where both add the beginning-of-sequence token or
neither does: lm-eval's API models add it with add_bos_token (--add-bos-token), its HFLM where
the model's family wants it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from deploy_sides import make_tiny_checkpoint, start_server
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI

PAIRS = [("the quick brown", " fox"), ("once upon a time", " there was"), ("hello", " world!")]


def requests() -> list[Instance]:
    """A loglikelihood request of each pair (context, continuation)."""
    return [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(PAIRS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint dir (default: a tiny model)")
    parser.add_argument(
        "--add-bos-token", action="store_true", help="lm-eval's API model adds the BOS token"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or make_tiny_checkpoint(Path(scratch) / "tiny")
        server, url = start_server(checkpoint, "cpu", "fp32", 8, source=None)
        try:
            api = LocalCompletionsAPI(
                base_url=f"{url}/v1/completions",
                model="bench",  # start_server's served_model_name
                tokenizer=str(checkpoint),
                tokenizer_backend="huggingface",
                add_bos_token=args.add_bos_token,
            )
            served = api.loglikelihood(requests())
        finally:
            server.terminate()
            server.wait()
        local = HFLM(pretrained=str(checkpoint), device="cpu", dtype="float32")
        own = local.loglikelihood(requests())
    for (context, continuation), (through, _), (alone, _) in zip(PAIRS, served, own, strict=True):
        print(f"{context!r} + {continuation!r}: runner deploy {through:.6f}, hf {alone:.6f}")
    difference = max(abs(a[0] - b[0]) for a, b in zip(served, own, strict=True))
    print(f"largest difference: {difference:.2e}")


if __name__ == "__main__":
    main()
