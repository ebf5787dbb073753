"""Weight sync from trainer ranks to vLLM engines: the vLLM parameter layout and flat buffers
(`layout.py`), CUDA IPC on the same GPU (`ipc.py`), NCCL to another GPU (`nccl.py`). The Ray
object-store path (numpy) needs nothing here."""
