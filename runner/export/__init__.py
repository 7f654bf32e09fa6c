"""Exports of a checkpoint: a LoRA adapter, a merged model, a GGUF file."""
