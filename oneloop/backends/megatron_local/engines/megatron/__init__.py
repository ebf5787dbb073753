"""The `megatron` trainer engine (megatron-core GPTModel): one rank (`trainer.py`), the group that
starts and drives several (`group.py`), weight layout, LoRA, optimizer offload and speed switches;
the parallel ranks (TP, PP, CP, LoRA-TP) in `parallel/`."""
