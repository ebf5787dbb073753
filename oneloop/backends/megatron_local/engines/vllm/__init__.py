"""The `vllm` sampler engine: the engine (`sampler.py`), its worker extension (`worker.py`), output
conversion (`outputs.py`) and its LoRA adapter books (`lora.py`). vLLM is imported lazily (or
inside its own worker), so these modules import without it."""
