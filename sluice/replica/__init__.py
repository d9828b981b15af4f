"""Triton replica host: the `tensorrt_llm` tensor interface over a pluggable engine."""
