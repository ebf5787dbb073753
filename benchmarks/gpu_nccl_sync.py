"""GPU benchmark, two GPUs (`nvidia-h200-x2`): in-flight weight sync from a trainer on GPU 0 to our
`vllm` sampler engine on GPU 1, side by side in one run:

- `nccl`        our path: the trainer packs vLLM's layout into one buffer and queues it on our NCCL
                group; the engine's worker receives every entry straight into its parameter storage;
- `nccl-buffer` the same, received into one scratch buffer and then copied into the parameters;
- `stock`       vLLM 0.26's own weight-transfer API (`weight_transfer_config=nccl`: pause(keep) →
                start_weight_update → update_weights ‖ trainer_send_weights(packed) → finish →
                resume), the reference path;
- the raw NCCL broadcast bandwidth between the same two processes (1 GiB x 10).

Rates: `load` = bytes / the whole load call (RPC included); `transfer` (ours only) = bytes / the
receive's GPU time, start of the receive to the last byte in its parameter (copies included).

Every round perturbs the trainer's weights, runs `--in-flight` requests (1,024 new tokens each)
through the sync, and checks that all complete in full and that the engine's weights equal the
trainer's (float64 checksums). At the end, vLLM's sampled-token logprobs are compared with the
trainer model's on the same tokens (mean |Δ|, bf16).

    python3 benchmarks/gpu_nccl_sync.py --model-dir DIR [--rounds 3]

Prints `RESULT {...}` lines; writes them to $OUT/gpu_nccl_sync.json when OUT is set.
"""

import argparse
import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

RESULTS: list[dict] = []


def result(**fields) -> None:
    RESULTS.append(fields)
    print("RESULT " + json.dumps(fields), flush=True)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="HF model directory")
    ap.add_argument("--rounds", type=int, default=5, help="syncs per path")
    ap.add_argument("--in-flight", type=int, default=32, help="requests decoding during a sync")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    ap.add_argument("--probe-bytes", type=int, default=1 << 30)
    return ap.parse_args()


def main() -> None:  # noqa: PLR0915 (one straight-line benchmark)
    args = parse()
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the trainer's GPU, before CUDA starts
    for k, v in dict(NCCL_NVLS_ENABLE="0", VLLM_WORKER_MULTIPROC_METHOD="spawn",
                     VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1",
                     HF_HUB_OFFLINE="1").items():  # fmt: skip
        os.environ.setdefault(k, v)
    import torch
    from transformers import AutoModelForCausalLM

    from oneloop.backends.megatron_local.engines.base import SampleRequest
    from oneloop.backends.megatron_local.ports import free_port
    from oneloop.backends.megatron_local.weight_sync.layout import hf_to_vllm_layout, pack_flat
    from oneloop.backends.megatron_local.weight_sync.nccl import NcclSender

    torch.cuda.set_device(0)
    trainer_dev = torch.device("cuda", 0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    model = model.to(trainer_dev).eval().requires_grad_(False)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    if (
        "lm_head.weight" in hf
        and hf["lm_head.weight"].data_ptr() == hf["model.embed_tokens.weight"].data_ptr()
    ):
        del hf["lm_head.weight"]  # tied: one tensor on the wire

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the engine's GPU (its process is spawned with it)
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerSendWeightsArgs,
        NCCLWeightTransferEngine,
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from oneloop.backends.megatron_local.engines.vllm.sampler import VllmSamplerEngine

    engine = VllmSamplerEngine(
        args.model_dir,
        gpu_memory_utilization=args.gpu_mem,
        max_model_len=2048,
        extra_engine_args={"weight_transfer_config": WeightTransferConfig(backend="nccl")},
    )
    pool = ThreadPoolExecutor(2)
    host = "127.0.0.1"
    try:
        # Our group and the stock one, each opened by both sides at once.
        port = free_port()
        sender_f = pool.submit(NcclSender, "bench", host, port, trainer_dev)
        engine.open_weight_group("bench", host, port, 2, 1)
        sender = sender_f.result(timeout=300)
        port2 = free_port()
        info = asdict(NCCLWeightTransferInitInfo(master_address=host, master_port=port2,
                                                 rank_offset=1, world_size=2))  # fmt: skip
        stock_f = pool.submit(
            NCCLWeightTransferEngine.trainer_init,
            dict(master_address=host, master_port=port2, world_size=2),
        )
        engine._wait(
            engine._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
            300,
            "stock init",
        )
        stock_group = stock_f.result(timeout=300)

        # Raw NCCL bandwidth between the same two processes.
        probe_f = pool.submit(sender.bandwidth_probe, args.probe_bytes, 10)
        engine.worker_call("nccl_bandwidth_probe", "bench", args.probe_bytes, 10)
        bw = args.probe_bytes * 10 / probe_f.result(timeout=300)
        result(bench="nccl_bandwidth", GBps=round(bw / 1e9, 1), bytes=args.probe_bytes)

        key = "inflight:bench"
        engine.set_weights(key, hf, 1)  # key switch, idle, reference loader: makes `key` live
        layout = engine.param_layout()
        names = list(hf)
        rng = np.random.default_rng(0)

        def perturb(seed: int) -> None:
            g = torch.Generator(device=trainer_dev).manual_seed(seed)
            with torch.no_grad():
                for t in hf.values():
                    noise = torch.randn(t.shape, generator=g, device=trainer_dev)
                    t.mul_((1 + 0.01 * noise).to(t.dtype))

        def trainer_checksum() -> float:
            return sum(float(t.double().abs().sum()) for _, t in hf_to_vllm_layout(hf, layout))

        def stock_send() -> float:
            torch.cuda.set_device(0)
            t0 = time.perf_counter()
            NCCLWeightTransferEngine.trainer_send_weights(
                iter(hf.items()), NCCLTrainerSendWeightsArgs(group=stock_group, packed=True)
            )
            torch.cuda.synchronize(trainer_dev)
            return time.perf_counter() - t0

        async def stock_sync() -> dict:
            llm = engine._engine
            update = asdict(NCCLWeightTransferUpdateInfo(
                names=names, dtype_names=[str(hf[n].dtype).split(".")[-1] for n in names],
                shapes=[list(hf[n].shape) for n in names], packed=True))  # fmt: skip
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            await llm.pause_generation(mode="keep", clear_cache=False)
            t1 = time.perf_counter()
            await llm.start_weight_update()
            sent = loop.run_in_executor(pool, stock_send)
            await asyncio.wait_for(
                llm.update_weights(WeightTransferUpdateRequest(update_info=update)), 300
            )
            await asyncio.wait_for(sent, 300)
            await llm.finish_weight_update()
            t2 = time.perf_counter()
            await llm.resume_generation()
            t3 = time.perf_counter()
            return dict(pause_ms=1e3 * (t1 - t0), load_ms=1e3 * (t2 - t1),
                        resume_ms=1e3 * (t3 - t2), window_ms=1e3 * (t3 - t0))  # fmt: skip

        def transfer_rates(transfer_ms: float | None) -> dict:
            if transfer_ms is None:  # stock: the transfer is not separable from its reload
                return {}
            return dict(transfer_GBps=round(nbytes / transfer_ms / 1e6, 1),
                        transfer_vs_nccl=round(nbytes / transfer_ms * 1e3 / bw, 3))  # fmt: skip

        version = 1
        nbytes = sum(t.numel() * t.element_size() for t in hf.values())
        for rnd in range(args.rounds):
            for path in ("nccl", "nccl-buffer", "stock"):
                version += 1
                perturb(1000 * rnd + version)
                futures = [
                    engine.submit_sample(
                        key,
                        SampleRequest(
                            prompt=rng.integers(1000, 150000, 128),
                            num_samples=1,
                            max_tokens=1024,
                            temperature=1.0,
                            seed=i,
                        ),
                    )  # fmt: skip
                    for i in range(args.in_flight)
                ]
                time.sleep(1.0)
                in_flight = sum(not f.done() for f in futures)
                t0 = time.perf_counter()
                if path == "stock":
                    rec = engine._wait(stock_sync(), 600, "stock sync")
                    prep_ms = 0.0
                else:
                    buffer, entries = pack_flat(hf_to_vllm_layout(hf, layout), trainer_dev)
                    into = "params" if path == "nccl" else "buffer"
                    weights = sender.send(buffer, entries, version, into=into)
                    prep_ms = 1e3 * (time.perf_counter() - t0)
                    engine.set_weights(key, weights, version)
                    sender.wait_sent()
                    r = engine.sync_history[-1]
                    rec = dict(pause_ms=r.pause_ms, load_ms=r.load_ms, resume_ms=r.resume_ms,
                               window_ms=r.window_ms, transfer_ms=r.transfer_ms)  # fmt: skip
                    del buffer
                outs = [f.result(timeout=600) for f in futures]
                complete = all(len(o.sequences[0].tokens) == 1024 for o in outs)
                engine_sum = engine.weights_checksum()[1]
                want = trainer_checksum()
                result(bench="sync", path=path, round=rnd, in_flight=in_flight,
                       all_complete=complete, bytes=nbytes, prep_ms=round(prep_ms, 1),
                       **{k: round(v, 1) for k, v in rec.items()},
                       load_GBps=round(nbytes / rec["load_ms"] / 1e6, 1),
                       load_vs_nccl=round(nbytes / rec["load_ms"] * 1e3 / bw, 3),
                       **transfer_rates(rec.get("transfer_ms")),
                       checksum_rel_diff=abs(engine_sum - want) / want)  # fmt: skip

        # vLLM's logprobs on the last weights vs the trainer model's on the same tokens.
        prompt = rng.integers(1000, 150000, 64)
        out = engine.sample(key, SampleRequest(prompt=prompt, num_samples=8, max_tokens=64,
                                               temperature=1.0, seed=5))  # fmt: skip
        gaps = []
        with torch.no_grad():
            for seq in out.sequences:
                full = torch.tensor(np.concatenate([prompt, seq.tokens]), device=trainer_dev)
                logits = model(input_ids=full[None]).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(1, full[1:, None])[:, 0]
                ours = lp[len(prompt) - 1 :].cpu().numpy()
                gaps.append(np.abs(ours - np.asarray(seq.logprobs, np.float32)))
        gap = np.concatenate(gaps)
        result(bench="logprob_gap_after_sync", mean=float(gap.mean()), max=float(gap.max()))

        summary = dict(bench="summary", nccl_GBps=round(bw / 1e9, 1))
        for path in ("nccl", "nccl-buffer", "stock"):
            rows = [r for r in RESULTS if r.get("path") == path]
            for field in ("window_ms", "load_ms", "load_GBps", "load_vs_nccl", "transfer_vs_nccl"):
                if field in rows[0]:
                    summary[f"{path}_{field}_median"] = float(np.median([r[field] for r in rows]))
            summary[f"{path}_all_complete"] = all(r["all_complete"] for r in rows)
        result(**summary)
    finally:
        engine.close()
        pool.shutdown(wait=False)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_nccl_sync.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
