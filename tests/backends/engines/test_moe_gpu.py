"""Device check of rollout routing replay (R3) on a real-width MoE: vLLM 0.26 samples with
`enable_return_routed_experts`, our torch trainer engine (bf16, CUDA) scores the same samples with
the recorded experts replayed and without; the sampled-token logprob gap with replay must be
strictly below the gap without, on the same samples.

Device only: `pytest -m gpu tests/backends/engines/test_moe_gpu.py` (skips without vLLM or CUDA;
needs the MoE kernel part, `scripts/device/prepare_moe_part.sh`). Model: Qwen3-30B-A3B's width
(hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 of width 768) at 4 layers, random
bf16 weights, built here (3.1 B parameters), or `ONELOOP_GPU_MOE_DIR`. Figures go to
`$OUT/moe_r3.json` when OUT is set. vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
the device README saw its multiprocess engine core hang once with R3 on).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec  # noqa: E402
from oneloop.backends.megatron_local.engines.torch.trainer import (  # noqa: E402
    TorchTrainerEngine,
)
from oneloop.backends.megatron_local.engines.vllm.routing import SCHEDULER_CLS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 32, 48, 64


def build_qwen3_moe(directory: Path) -> Path:
    """The 4-layer Qwen3-30B-A3B-width random MoE (`build_random_qwen3.py --shape 30b-a3b-4l`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "device" / "runbook"))
    from build_random_qwen3 import build

    return build("30b-a3b-4l", directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    given = os.environ.get("ONELOOP_GPU_MOE_DIR")
    if given:
        return Path(given)
    return build_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-4l"))


def _vllm_samples(model_dir: Path) -> list[tuple[np.ndarray, list[int], list[float], np.ndarray]]:
    """(prompt, tokens, sampled-token logprobs, routed experts) per prompt, from vLLM with our
    scheduler (`vllm.routing`: the record read once per finished request)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        str(model_dir), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.4,
        max_model_len=1024, enable_return_routed_experts=True, skip_tokenizer_init=True,
        attention_backend="TRITON_ATTN",  # the device wheel has no flash-attention kernels
        scheduler_cls=SCHEDULER_CLS,  # the record our sampler engine returns
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150000, PROMPT_TOKENS) for _ in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, logprobs=0, seed=0,
                            ignore_eos=True, detokenize=False)  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params)
    samples = []
    for prompt, out in zip(prompts, outputs, strict=True):
        done = out.outputs[0]
        logprobs = [d[t].logprob for d, t in zip(done.logprobs, done.token_ids, strict=True)]
        routed = np.asarray(done.routed_experts)
        assert routed.shape[0] == len(prompt) + len(done.token_ids) - 1, routed.shape
        samples.append((prompt, list(done.token_ids), logprobs, routed))
    del llm
    torch.cuda.empty_cache()
    return samples


def test_vllm_routing_replay_lowers_the_trainer_sampler_gap(model_dir):
    samples = _vllm_samples(model_dir)
    trainer = TorchTrainerEngine(model_dir, LoraSpec(rank=0), dtype="bfloat16", device="cuda")
    layers, k = len(trainer.routers), int(trainer.routers[0].top_k)
    data = []
    for prompt, tokens, logprobs, routed in samples:
        full = np.concatenate([prompt, tokens]).astype(np.int64)
        n = len(full) - 1
        assert routed.ndim == 3 and routed.shape[1:] == (layers, k), routed.shape
        sampler_lp = np.zeros(n, np.float32)
        sampler_lp[len(prompt) - 1 :] = logprobs
        data.append(
            DatumArrays(
                full[:-1],
                full[1:],
                {"logprobs": sampler_lp, "advantages": (sampler_lp != 0).astype(np.float32)},
                routing=routed[:n].astype(np.int16),
            )
        )
    metrics = trainer.forward_backward(data, "importance_sampling", None, True).metrics
    tokens = metrics["routing/gap_tokens:sum"]
    figures = {
        "gap_replay_mean": metrics["routing/gap_replay:sum"] / tokens,
        "gap_free_mean": metrics["routing/gap_free:sum"] / tokens,
        "routing_differ_frac": metrics["routing/differ:sum"] / metrics["routing/positions:sum"],
        "sampled_tokens": tokens,
        "routed_experts_rows_per_sample": [int(s[3].shape[0]) for s in samples[:2]],
    }
    print("RESULT moe_r3", figures)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe_r3.json").write_text(json.dumps(figures, indent=1))
    assert figures["gap_replay_mean"] < figures["gap_free_mean"], figures


CHECKED: list[tuple[str, np.ndarray, np.ndarray]] = []  # (request id, vLLM's pieces, ours)
LENGTHS: dict[str, tuple] = {}  # request id -> (prompt tokens, tokens, rows of each vLLM piece)


class _CheckingScheduler:
    """`RoutingAtFinish` with vLLM's own per-step pieces left on beside it: every finished
    request's record is kept both ways (in-process engine core, so the test reads `CHECKED`)."""

    def __new__(cls, *args, vllm_config, **kwargs):
        from oneloop.backends.megatron_local.engines.vllm.routing import scheduler_classes

        base = scheduler_classes()[bool(vllm_config.scheduler_config.async_scheduling)]

        class Checking(base):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.enable_return_routed_experts = True  # vLLM's pieces as well
                self.pieces: dict[str, list[np.ndarray]] = {}
                self.lengths: dict[str, tuple[int, int]] = {}

            def _free_request(self, request, *a, **kw):
                self.lengths[request.request_id] = (request.num_prompt_tokens, request.num_tokens)
                return super()._free_request(request, *a, **kw)

            def _attach_routing(self, outputs):
                for engine_outputs in outputs.values():
                    for out in engine_outputs.outputs:
                        if out.routed_experts is not None:
                            self.pieces.setdefault(out.request_id, []).append(out.routed_experts)
                ours = dict(self._finished_routing)
                super()._attach_routing(outputs)
                for rid, routing in ours.items():
                    pieces = self.pieces.pop(rid)
                    CHECKED.append((rid, np.concatenate(pieces), routing))
                    LENGTHS[rid] = (*self.lengths.pop(rid), [len(p) for p in pieces])

        return Checking(*args, vllm_config=vllm_config, **kwargs)


def test_routing_read_at_finish_equals_vllms_per_step_pieces(model_dir):
    """The record `RoutingAtFinish` reads once per finished request equals, row for row and in
    dtype, the one vLLM assembles from its per-step pieces: prompts sampled twice (n=2), ragged
    lengths, and a second round on the same prompts that reads the prompt rows through prefix
    cache hits."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        str(model_dir), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.4,
        max_model_len=1024, enable_return_routed_experts=True, skip_tokenizer_init=True,
        attention_backend="TRITON_ATTN",  # the device wheel has no flash-attention kernels
        enable_prefix_caching=True, scheduler_cls=_CheckingScheduler,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 150000, int(rng.integers(8, 96))) for _ in range(PROMPTS)]
    requests = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
    for round_ in range(2):
        params = [
            SamplingParams(n=2, temperature=1.0, max_tokens=int(rng.integers(1, NEW_TOKENS)),
                           seed=round_ * 1000 + i, ignore_eos=True, detokenize=False)
            for i in range(PROMPTS)
        ]  # fmt: skip
        llm.generate(requests, params)
    del llm
    torch.cuda.empty_cache()
    assert len(CHECKED) == 2 * 2 * PROMPTS
    differ = []
    for rid, theirs, ours in CHECKED:
        assert ours.dtype == theirs.dtype, (rid, ours.dtype, theirs.dtype)
        if ours.shape != theirs.shape or not np.array_equal(ours, theirs):
            n = min(len(ours), len(theirs))
            rows = (ours[:n] != theirs[:n]).any(axis=(1, 2))
            head = int(np.argmax(rows)) if rows.any() else -1  # first differing row, -1: none
            differ.append((rid, LENGTHS[rid], ours.shape[0], theirs.shape[0], head))
    assert not differ, (len(differ), differ[:8])
    print("RESULT routing_at_finish", {"requests": len(CHECKED), "equal": True})
