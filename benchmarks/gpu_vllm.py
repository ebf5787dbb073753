"""GPU benchmark of the `vllm` sampler engine (device machine only), side by side in one run.

(i)  throughput: our engine's `sample` (sync contract from a thread pool, and `submit_sample`
     futures) vs raw vLLM `AsyncLLM` with the same engine args, prompts and sampling params;
     prints the ratio (goal >= 0.97).
     With `--routed-experts` (a MoE model): our engine and raw vLLM return every sequence's routed
     experts (R3's record), and raw vLLM runs once more without them: the record's cost in
     tokens/s (goal <= 5 %). R3 on runs our scheduler (`engines/vllm/routing.py`: each
     request's record read once, when it finishes); `--stock-routing` adds raw vLLM with its own
     per-step pieces beside it. `--interleave`: those two raw engines alive together, the reps
     alternating (rep-to-rep spread on the device is 20-30 %, and a side run last drifted);
     `--raw-only --engine-args '{"load_format": "dummy", ...}'`: raw vLLM alone, e.g. deeper.
     `--all-alive`: our engine stays up beside the raw engines and runs as one more side of the
     alternating reps (`ours_futures`), so ours / raw and R3's cost are paired per rep
     (`*_paired_median`: the median over reps of the two sides' ratio in that rep).
     `--skip-clear-side` (run under benchmarks/r3prof): one more raw R3-on engine whose worker
     skips vLLM's per-step zeroing of the routing capture buffer (`R3PROF_SKIP_CLEAR`).
(ii) in-flight weight sync with N requests decoding: pause window and effective GB/s of
     - `ipc`    : one CUDA buffer in vLLM's layout over CUDA IPC, copied into the parameters,
     - `ipc-hf` : the same transport, loaded by the model's own `load_weights` (stock loader),
     - `hf`     : Hugging Face tensors as bytes over vLLM's RPC, then `load_weights`.

    python3 benchmarks/gpu_vllm.py [--model-dir DIR] [--eager] [--prompts 256] [--rounds 3]

Prints `RESULT {...}` lines; writes them all to $OUT/gpu_vllm.json when OUT is set.
"""

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from oneloop.backends.megatron_local.engines.base import SampleRequest
from oneloop.backends.megatron_local.engines.vllm.routing import SCHEDULER_CLS
from oneloop.backends.megatron_local.engines.vllm.sampler import VllmSamplerEngine
from oneloop.backends.megatron_local.weight_sync.ipc import make_ipc_weights, pack_for_engine
from oneloop.backends.megatron_local.weight_sync.layout import pack_flat

RESULTS: list[dict] = []


def result(**fields) -> None:
    RESULTS.append(fields)
    print("RESULT " + json.dumps(fields), flush=True)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, help="HF model dir; default: build random Qwen3 0.6B")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--gpu-mem", type=float, default=0.4, help="gpu_memory_utilization")
    ap.add_argument("--prompts", type=int, default=256, help="prompts in the throughput run")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt")
    # 5: two reps were too few on the H200 (a 0.87 best-of-2 ratio, then 1.05 best-of-5)
    ap.add_argument("--reps", type=int, default=5, help="timed throughput repetitions per side")
    ap.add_argument("--in-flight", type=int, default=32, help="requests decoding during a sync")
    ap.add_argument("--rounds", type=int, default=3, help="syncs per load path")
    ap.add_argument("--skip-raw", action="store_true", help="skip the raw AsyncLLM side")
    ap.add_argument("--skip-sync", action="store_true", help="skip the in-flight sync bench")
    ap.add_argument(
        "--routed-experts",
        action="store_true",
        help="MoE: return routed experts (R3), and measure raw vLLM without them too",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="--routed-experts: raw vLLM with and without them alive together, reps alternating",
    )
    ap.add_argument(
        "--stock-routing",
        action="store_true",
        help="--routed-experts: also raw vLLM with its own per-step routing pieces (not ours)",
    )
    ap.add_argument(
        "--all-alive",
        action="store_true",
        help="our engine alive beside the raw engines, one more side of the alternating reps",
    )
    ap.add_argument(
        "--skip-clear-side",
        action="store_true",
        help="R3 on: one more raw side without the capture buffer's per-step zeroing (r3prof)",
    )
    ap.add_argument(
        "--raw-only",
        action="store_true",
        help="raw vLLM only (no engine of ours; e.g. a deeper model with dummy weights)",
    )
    ap.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        help='extra vLLM engine args as JSON, e.g. \'{"load_format": "dummy"}\'',
    )
    return ap.parse_args()


def build_model(directory: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    torch.cuda.empty_cache()
    return directory


def prompts(n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = random.Random(seed)
    return [
        np.array([rng.randrange(1000, 150000) for _ in range(length)], dtype=np.int64)
        for _ in range(n)
    ]


def request(p: np.ndarray, max_tokens: int, seed: int) -> SampleRequest:
    return SampleRequest(prompt=p, num_samples=1, max_tokens=max_tokens, seed=seed)


def ours_throughput(engine: VllmSamplerEngine, args, ps: list[np.ndarray]) -> None:
    key = "base"
    engine.sample(key, request(ps[0], 16, 0))  # warm-up
    with ThreadPoolExecutor(max_workers=len(ps)) as pool:
        for rep in range(args.reps):
            t0 = time.perf_counter()
            outs = list(
                pool.map(
                    lambda ip: engine.sample(key, request(ip[1], args.max_tokens, ip[0])),
                    enumerate(ps),
                )
            )
            dt = time.perf_counter() - t0
            tokens = sum(len(o.sequences[0].tokens) for o in outs)
            result(
                bench="throughput",
                side="ours_sync_threads",
                rep=rep,
                tokens=tokens,
                seconds=round(dt, 3),
                tok_per_s=round(tokens / dt),
            )
    for rep in range(args.reps):
        t0 = time.perf_counter()
        futures = [
            engine.submit_sample(key, request(p, args.max_tokens, i)) for i, p in enumerate(ps)
        ]
        outs = [f.result(timeout=600) for f in futures]
        dt = time.perf_counter() - t0
        tokens = sum(len(o.sequences[0].tokens) for o in outs)
        result(bench="throughput", side="ours_futures", rep=rep, tokens=tokens,
               seconds=round(dt, 3), tok_per_s=round(tokens / dt))  # fmt: skip


def raw_throughput(
    engine_kwargs: dict, args, ps: list[np.ndarray], side: str = "raw_asyncllm"
) -> None:
    """Raw vLLM: same engine args, same prompts, same SamplingParams, on one asyncio loop."""
    raw_sides([(side, engine_kwargs)], args, ps)


def raw_sides(
    sides: list[tuple[str, dict]], args, ps: list[np.ndarray], ours: VllmSamplerEngine | None = None
) -> None:
    """Raw vLLM engines alive together (one per (side, engine args)), each timed rep running
    every side once, the order rotated each rep: a drift of the machine hits all sides alike.
    `ours`: our engine (already started) is one more side, `ours_futures`, its requests submitted
    from this loop as futures (the loop's own way of calling it)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def one(llm, routed: bool, p: np.ndarray, seed: int, max_tokens: int) -> int:
        params = SamplingParams(
            n=1, max_tokens=max_tokens, seed=seed, stop_token_ids=[], ignore_eos=True,
            logprobs=0, detokenize=False, flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        final = None
        engine_input = tokens_input([int(t) for t in p], cache_salt="base@v0")
        async for out in llm.generate(engine_input, params, request_id=uuid.uuid4().hex):
            final = out
        assert final is not None and final.outputs[0].logprobs is not None
        if routed:  # R3's record came back
            assert final.outputs[0].routed_experts is not None
        return len(final.outputs[0].token_ids)

    async def ours_rep(rep: int) -> list[int]:
        futures = [
            asyncio.wrap_future(ours.submit_sample("base", request(p, args.max_tokens, i)))
            for i, p in enumerate(ps)
        ]
        outs = await asyncio.gather(*futures)
        if ours.returns_routed_experts:
            assert all(o.sequences[0].routed_experts is not None for o in outs), "no R3 record"
        return [len(o.sequences[0].tokens) for o in outs]

    async def main() -> None:
        llms = []
        try:
            for side, kwargs in sides:
                os.environ["R3PROF_PHASE"] = side  # benchmarks/r3prof: the engine core's key
                # inherited by this side's engine core only (spawned while it is set)
                os.environ["R3PROF_SKIP_CLEAR"] = "1" if side.endswith("_skip_clear") else "0"
                llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
                os.environ["R3PROF_SKIP_CLEAR"] = "0"
                llms.append((side, llm, bool(kwargs.get("enable_return_routed_experts"))))
                await asyncio.wait_for(one(llm, llms[-1][2], ps[0], 0, 16), 600)
            order = llms + ([("ours_futures", None, False)] if ours is not None else [])
            for rep in range(args.reps):
                shift = rep % len(order)  # each side in each position of the order in turn
                for side, llm, routed in order[shift:] + order[:shift]:
                    os.environ["R3PROF_PHASE"] = side  # the front end's own timings
                    t0 = time.perf_counter()
                    work = (
                        ours_rep(rep)
                        if llm is None
                        else asyncio.gather(
                            *[one(llm, routed, p, i, args.max_tokens) for i, p in enumerate(ps)]
                        )
                    )
                    counts = await asyncio.wait_for(work, 600)
                    dt = time.perf_counter() - t0
                    result(bench="throughput", side=side, rep=rep, tokens=sum(counts),
                           seconds=round(dt, 3), tok_per_s=round(sum(counts) / dt))  # fmt: skip
        finally:
            for _, llm, _ in llms:
                llm.shutdown()

    asyncio.run(main())


def raw_engines(kwargs: dict, args) -> list[tuple[str, dict]]:
    """(side, engine args) of the raw vLLM engines a run times: our engine's args and, for a MoE
    with R3 on, without the record (R3 off, vLLM's stock scheduler), with vLLM's own per-step
    pieces (`--stock-routing`) and without the capture buffer's zeroing (`--skip-clear-side`).
    R3 on, raw_asyncllm runs our scheduler (`vllm.routing`: the record read once a request)."""
    sides = [("raw_asyncllm", kwargs)]
    if args.routed_experts:
        stock = {k: v for k, v in kwargs.items() if k != "scheduler_cls"}
        sides.append(("raw_asyncllm_no_routed_experts",
                      {**stock, "enable_return_routed_experts": False}))  # fmt: skip
        if args.stock_routing:
            sides.append(("raw_asyncllm_stock_routing", stock))
        if args.skip_clear_side:
            sides.append(("raw_asyncllm_skip_clear", kwargs))
    return sides


def sync_bench(engine: VllmSamplerEngine, args, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    head, embed = hf.get("lm_head.weight"), hf["model.embed_tokens.weight"]
    if head is not None and head.data_ptr() == embed.data_ptr():
        del hf["lm_head.weight"]  # tied: vLLM skips it anyway; keep byte counts honest
    key = "inflight:bench"
    engine.set_weights(key, hf, version=1)  # key switch, idle: makes `key` live
    version = 1
    layout = engine.param_layout()
    for path in ("ipc", "ipc-hf", "hf"):
        for rnd in range(args.rounds):
            version += 1
            t0 = time.perf_counter()
            buffer = None
            if path == "ipc":
                buffer, payload = pack_for_engine(hf, layout, "cuda", version)
            elif path == "ipc-hf":
                buffer, entries = pack_flat(list(hf.items()), "cuda")
                payload = make_ipc_weights(buffer, entries, version, layout="hf")
            else:
                payload = hf
            torch.cuda.synchronize()
            prep_ms = 1e3 * (time.perf_counter() - t0)
            futures = [
                engine.submit_sample(key, request(p, 1024, i))
                for i, p in enumerate(prompts(args.in_flight, args.prompt_len, 77 + rnd))
            ]
            time.sleep(1.0)
            in_flight = sum(not f.done() for f in futures)
            engine.set_weights(key, payload, version)
            outs = [f.result(timeout=600) for f in futures]
            record = engine.sync_history[-1]
            complete = all(len(o.sequences[0].tokens) == 1024 for o in outs)
            result(bench="sync", path=path, round=rnd, in_flight=in_flight, all_complete=complete,
                   bytes=record.bytes, prep_ms=round(prep_ms, 1),
                   pause_ms=round(record.pause_ms, 1), load_ms=round(record.load_ms, 1),
                   resume_ms=round(record.resume_ms, 1), window_ms=round(record.window_ms, 1),
                   load_GBps=round(record.bytes / record.load_ms / 1e6, 1),
                   window_GBps=round(record.bytes / record.window_ms / 1e6, 1))  # fmt: skip
            del buffer, payload
    del model, hf
    torch.cuda.empty_cache()


def summarize(ours: bool = True) -> None:
    def rates(side: str) -> list[float]:
        return [r["tok_per_s"] for r in RESULTS if r.get("side") == side] or [float("nan")]

    def paired(side: str, base: str) -> float:
        """Median over reps of side / base within each rep (both sides ran in that rep)."""
        by_rep = {
            (r["side"], r["rep"]): r["tok_per_s"] for r in RESULTS if r.get("bench") == "throughput"
        }
        ratios = [v / by_rep[(base, rep)] for (s, rep), v in by_rep.items()
                  if s == side and (base, rep) in by_rep]  # fmt: skip
        return round(float(np.median(ratios)), 3) if ratios else float("nan")

    raw = max(rates("raw_asyncllm"))
    raw_median = float(np.median(rates("raw_asyncllm")))
    summary = dict(bench="summary", raw_tok_per_s=raw)
    if ours:
        summary.update(ours_sync_ratio=round(max(rates("ours_sync_threads")) / raw, 3),
                       ours_futures_ratio=round(max(rates("ours_futures")) / raw, 3),
                       # medians too: one rep on this machine spans 19-28k tok/s (2026-12-01)
                       ours_sync_ratio_median=round(
                           float(np.median(rates("ours_sync_threads"))) / raw_median, 3),
                       ours_futures_ratio_median=round(
                           float(np.median(rates("ours_futures"))) / raw_median, 3))  # fmt: skip
        summary["ours_futures_ratio_paired_median"] = paired("ours_futures", "raw_asyncllm")
    plain = rates("raw_asyncllm_no_routed_experts")
    if plain[0] == plain[0]:  # measured (not NaN): R3's record on vs off, raw vLLM
        off = "raw_asyncllm_no_routed_experts"
        summary["routed_experts_cost"] = round(1.0 - raw_median / float(np.median(plain)), 3)
        summary["routed_experts_cost_best"] = round(1.0 - raw / max(plain), 3)
        summary["routed_experts_cost_paired_median"] = round(1.0 - paired("raw_asyncllm", off), 3)
        if ours:  # our engine with R3 on vs raw vLLM with R3 off
            summary["ours_routed_experts_cost_paired_median"] = round(
                1.0 - paired("ours_futures", off), 3
            )
        stock = rates("raw_asyncllm_stock_routing")
        if stock[0] == stock[0]:  # vLLM's own per-step pieces, same machine, same run
            summary["routed_experts_cost_stock"] = round(
                1.0 - float(np.median(stock)) / float(np.median(plain)), 3
            )
            summary["routed_experts_cost_stock_paired_median"] = round(
                1.0 - paired("raw_asyncllm_stock_routing", off), 3
            )
        if any(r.get("side") == "raw_asyncllm_skip_clear" for r in RESULTS):
            summary["routed_experts_cost_skip_clear_paired_median"] = round(
                1.0 - paired("raw_asyncllm_skip_clear", off), 3
            )
    for path in ("ipc", "ipc-hf", "hf"):
        windows = [r["window_ms"] for r in RESULTS if r.get("path") == path]
        rates = [r["load_GBps"] for r in RESULTS if r.get("path") == path]
        if windows:
            summary[f"{path}_window_ms_median"] = float(np.median(windows))
            summary[f"{path}_load_GBps_median"] = float(np.median(rates))
    result(**summary)


def main() -> None:
    args = parse()
    for k, v in dict(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                     VLLM_USE_FLASHINFER_SAMPLER="0").items():  # fmt: skip
        os.environ.setdefault(k, v)
    model_dir = args.model_dir or build_model(Path(tempfile.mkdtemp(prefix="qwen3_")))
    ps = prompts(args.prompts, args.prompt_len, seed=1)
    if args.raw_only:  # the engine args ours would pass, less its worker extension
        kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                      gpu_memory_utilization=args.gpu_mem, max_model_len=2048,
                      enforce_eager=args.eager, seed=0, max_num_seqs=256,
                      attention_backend="TRITON_ATTN", logprobs_mode="raw_logprobs",
                      enable_prefix_caching=True, disable_log_stats=True,
                      enable_return_routed_experts=args.routed_experts,
                      **({"scheduler_cls": SCHEDULER_CLS} if args.routed_experts else {}),
                      **args.engine_args)  # fmt: skip
    else:
        os.environ["R3PROF_PHASE"] = "ours"
        t0 = time.perf_counter()
        engine = VllmSamplerEngine(model_dir, gpu_memory_utilization=args.gpu_mem,
                                   max_model_len=2048, enforce_eager=args.eager,
                                   return_routed_experts=args.routed_experts,
                                   extra_engine_args=args.engine_args or None)  # fmt: skip
        result(bench="start", side="ours", seconds=round(time.perf_counter() - t0, 1))
        kwargs = engine.engine_kwargs
        if args.all_alive:  # our engine stays up: one more side of raw_sides' reps
            try:
                engine.sample("base", request(ps[0], 16, 0))  # warm-up
                raw_sides(raw_engines(kwargs, args), args, ps, ours=engine)
                summarize()
                if not args.skip_sync:
                    sync_bench(engine, args, model_dir)
            finally:
                engine.close()
            args.skip_raw = True  # measured above
        else:
            try:
                ours_throughput(engine, args, ps)
                if not args.skip_sync:
                    sync_bench(engine, args, model_dir)
            finally:
                engine.close()
    if not args.skip_raw:
        sides = raw_engines(kwargs, args)
        if args.routed_experts and args.interleave:  # alive together, reps alternating
            raw_sides(sides, args, ps)
        else:  # one engine after another
            for side, side_kwargs in sides:
                raw_throughput(side_kwargs, args, ps, side=side)
        summarize(ours=not args.raw_only)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_vllm.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
