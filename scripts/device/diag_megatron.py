"""Diagnostic: megatron engine vs transformers logits on one unpadded sequence, fp32 and bf16."""

import sys

import numpy as np
import torch

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec
from oneloop.backends.megatron_local.engines.megatron_trainer import MegatronTrainerEngine
from oneloop.backends.megatron_local.engines.torch_trainer import TorchTrainerEngine

from pathlib import Path
path = Path(sys.argv[1])
rng = np.random.default_rng(0)
toks = rng.integers(0, 151936, 257)
pad = [DatumArrays(toks[:-1], toks[1:], {"weights": np.ones(256, np.float32)}),
       DatumArrays(toks[:101], toks[1:102], {"weights": np.ones(101, np.float32)})]
for dtype in ("float32", "bfloat16"):
    m = MegatronTrainerEngine(path, LoraSpec(0), dtype=dtype, device="cuda")
    t = TorchTrainerEngine(path, LoraSpec(0), dtype=dtype, device="cuda")
    for name, data in (("one", pad[:1]), ("padded", pad)):
        a = m.forward_backward(data, "cross_entropy", None, True)
        b = t.forward_backward(data, "cross_entropy", None, True)
        d = np.abs(a.logprobs[0] - b.logprobs[0])
        print(dtype, name, "loss", a.loss, b.loss, "lp diff mean", d.mean(), "max", d.max(),
              "first5", d[:5].round(4), "last", d[-3:].round(4), flush=True)
    print("theta", m.shape.rope_theta, "qk", m.shape.qk_norm, "tied", m.shape.tied, flush=True)
    del m, t
    torch.cuda.empty_cache()
