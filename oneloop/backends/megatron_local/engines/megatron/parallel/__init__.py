"""Parallel ranks of the `megatron` engine: tensor (`tp`, `shard`, `lora_tp`, `lora_shard`),
pipeline (`pp`, `pp_plan`) and context (`cp`, `cp_rank`) parallelism."""
