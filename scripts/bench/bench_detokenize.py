"""A streamed answer's text, a token at a time: tokenizers' DecodeStream beside windows of ids
decoded through transformers (runner/deploy/text.py's two ways), microseconds a token.

    python scripts/bench/bench_detokenize.py [--tokens 256] [--repeats 5] [--tokenizer DIR]

Each way pushes the same ids (TEXT's, repeated to --tokens; its "é" and "à" are two byte
tokens each in byte-level tokenizers) through a TextStream that streams (no stop sequences),
reading its delta after each token as the engine does for a streamed choice, then its end; the
figure is the median over --repeats runs of the whole stream's time over its tokens, with the
range. Both must give the whole answer's text (runner.deploy.text.decode of all the ids).
Without --tokenizer: runner's tiny tokenizer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from runner.deploy.text import TextStream, decode, steps_decode
from runner.paths import TINY_TOKENIZER_DIR

TEXT = "The model reads a prompt and writes an answer, one token at a time: déjà vu. "


def stream_us(tokenizer, ids: list[int], step_decoding: bool, repeats: int) -> list[float]:
    """Microseconds a token of each repeat; raises if the text is not decode's."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        stream = TextStream(tokenizer, [], incremental=True, step_decoding=step_decoding)
        parts = []
        for token_id in ids:
            stream.push(token_id)
            parts.append(stream.ready())
        parts.append(stream.finish())
        rates.append((time.perf_counter() - started) / len(ids) * 1e6)
        if "".join(parts) != decode(tokenizer, ids):
            raise SystemExit(f"step_decoding={step_decoding}: not the text decode gives")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, default=TINY_TOKENIZER_DIR)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    once = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = (once * (args.tokens // len(once) + 1))[: args.tokens]
    print(f"{args.tokenizer.name}: {len(ids)} tokens, steps_decode {steps_decode(tokenizer)}")
    for label, step_decoding in (("DecodeStream", True), ("windows", False)):
        rates = stream_us(tokenizer, ids, step_decoding, args.repeats)
        low, high = min(rates), max(rates)
        print(f"{label}: {statistics.median(rates):.2f} us a token ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
