"""The `torch` engines: a transformers trainer (`trainer.py`) and sampler (`sampler.py`), on CPU
or GPU.

Imports inside are absolute, so `import torch` here still means PyTorch."""
