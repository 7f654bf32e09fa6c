"""Serving checkpoints: the OpenAI-compatible server (routes, protocol, limits) over an engine."""
