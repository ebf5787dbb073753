"""Engines of the local backend, by kind: `torch/`, `vllm/`, `megatron/`, behind the contracts in
`base.py`; `factory.py` picks one from the config; `microbatch.py`, `hf.py` and
`fused_logprobs.py` are shared by every kind."""
