"""SmolLM2-135M-Instruct in numpy: weights (GGUF → float32 cache), the paged forward, sampling,
and the executor that runs them behind the engine core (engine.executor)."""
