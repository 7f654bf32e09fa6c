"""Serving checkpoints (`runner deploy`): an OpenAI-compatible server over one engine per model.

- serve: the command's body: what to serve, the API key, the bound socket, the loaded models;
- selection: `checkpoint=` paths (checkpoint, run or sweep dirs) -> checkpoint dirs and names;
- loading: a checkpoint's weights (safetensors only), tokenizer, context, device and dtype;
- routes: the FastAPI app, its routes, the API key check and the error responses;
- protocol: the request bodies, their limits and checks, and the response bodies;
- generation: what crosses between the routes and an engine (requests, events, handles);
- engine: engine=transformers, continuous batching in one thread (kv_cache: its KV cache in
  fixed buffers; decode_step: each step's forward, replayed from CUDA graphs on a GPU; text:
  detokenizing and stop sequences);
- vllm_engine: engine=vllm, imported only when chosen.
"""

from __future__ import annotations
