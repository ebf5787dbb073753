"""Sampler engine `vllm`: one vLLM `AsyncLLM` on its own event loop, behind the sync contract.

- The engine runs on a private asyncio loop in a daemon thread; the contract's sync methods submit
  coroutines to it and wait with a timeout, so any number of threads may call at once
  (`base.ConcurrentSampler`). `submit_sample` returns a future for callers that own an event loop.
- Token-id prompts (`skip_tokenizer_init`), one logprob per sampled token (`logprobs=0`) in
  `logprobs_mode="raw_logprobs"`: the model's log-softmax before temperature / top-k / top-p, the
  same quantity the trainer computes. `num_samples` is vLLM's `n`; vLLM seeds child i with
  `seed + i`, so the same seed gives the same tokens and sample i does not depend on num_samples.
- Stops: exactly `request.stop_token_ids` (we pass `ignore_eos=True` so vLLM adds no EOS of its
  own, like the torch engine, whose caller puts the EOS ids into the request); a stop token ends
  and is included in the sequence. Stop *strings* need a tokenizer vLLM does not have here: a
  request with `stop_strings` is rejected with a clear error.
- One weight set: vLLM holds one copy of the weights. "base" is live at version 0 until the first
  `set_weights(key, ...)`, which replaces the weights in place and makes `key` live; other keys are
  evicted (sampling on them raises). Same key → in-flight sync: `pause_generation(mode="keep",
  clear_cache=False)` → load → `resume_generation()`; requests in flight keep their KV and go on
  with the new weights. Another key → `mode="wait"`: requests of the old key finish on the old
  weights first. New requests carry `cache_salt=f"{key}@v{version}"` so they never reuse prefix
  KV computed with other weights. Phase timings of every sync land in `sync_history`, with the
  number of requests in flight when the pause began.
- LoRA runs (`lora` given): the engine starts with LoRA enabled and each weight key holds a
  vLLM LoRA module (`base.AdapterDir` payloads; `vllm.lora.AdapterTable` keeps the books):
  the base weights never change, every snapshot keeps its own adapter, and replacing a key's
  adapter needs no pause: requests already running finish on the adapter they started with (and
  report its version), new ones take the new one; an adapter is unloaded once no key holds it and
  its last request ended. Full-weight updates are refused on such an engine.
- Loads go through `collective_rpc` into `vllm.worker.OneloopWorkerExtension`: a dict of
  Hugging Face arrays (reference: the model's own `load_weights`), `CudaIpcWeights` (same GPU:
  straight copies into the parameters' storage) or `NcclWeights` (a trainer on another GPU:
  received straight into the parameters' storage over a group opened by `open_weight_group`).
- Rollout routing replay (`return_routed_experts`, MoE models): vLLM's
  `enable_return_routed_experts`; every sampled sequence carries the experts each MoE layer routed
  each fed position to (`SampledArrays.routed_experts`, the record the trainer replays), read once
  per finished request from vLLM's slot buffer (`vllm.routing`; `routing_at_finish=False` keeps
  vLLM's own per-step pieces).
- Tensor parallelism (`tp` > 1, `local.vllm.tp`): vLLM's worker processes on the actor's tp GPUs;
  every load is a `collective_rpc` that each worker runs on its own shard (the Hugging Face path:
  vLLM's loader slices each tensor per rank), and `SyncRecord.workers` counts the ranks that
  loaded. The CUDA IPC / NCCL paths carry one worker's layout: refused at tp > 1 (config).
"""

import asyncio
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oneloop.backends.megatron_local.engines.base import (
    AdapterDir,
    SampleOutput,
    SamplerEngine,
    SampleRequest,
)
from oneloop.backends.megatron_local.engines.vllm.lora import Adapter, AdapterTable, LoraServing
from oneloop.backends.megatron_local.engines.vllm.outputs import (
    hf_payload,
    lora_request,
    prompt_logprob_array,
    sequence,
)
from oneloop.backends.megatron_local.engines.vllm.routing import SCHEDULER_CLS
from oneloop.backends.megatron_local.weight_sync.ipc import CudaIpcWeights
from oneloop.backends.megatron_local.weight_sync.nccl import NcclWeights
from oneloop.errors import BackendError, RequestError

BASE_KEY = "base"
WORKER_EXTENSION = "oneloop.backends.megatron_local.engines.vllm.worker.OneloopWorkerExtension"
START_TIMEOUT_S = 900.0  # engine start incl. torch.compile + CUDA graph capture (~71 s measured)
RPC_TIMEOUT_S = 300.0  # one weight load / layout query
DRAIN_TIMEOUT_S = 600.0  # pause(mode="wait") drains every running request of the old key
SUBMIT_POLL_S = 0.001  # while closing admission: how often to look for pending submissions


@dataclass(frozen=True)
class SyncRecord:
    """One weight update: phase times in ms, payload size, and which path moved the bytes."""

    key: str
    version: int
    # "lora" (adapter loaded as a vLLM LoRA module) | "hf" (load_weights, bytes over RPC) |
    # "ipc" (direct copy) | "ipc-hf" (IPC + loader) |
    # "nccl" (received into the parameters) | "nccl-buffer" (received, then copied)
    path: str
    mode: str  # pause mode: "keep" (same key, in flight) | "wait" (key switch) | "none" (LoRA)
    bytes: int
    pause_ms: float
    load_ms: float
    resume_ms: float
    window_ms: float  # pause call start → resume returned: what in-flight requests feel
    transfer_ms: float | None = None  # NCCL only: GPU time of the receive itself (within load)
    workers: int = 1  # engine workers (tensor-parallel ranks) that loaded their shard
    # Requests in vLLM (added, not finished) when the pause began: a keep-mode pause returns once
    # the engine step under way has ended (vLLM 0.26 `pause_scheduler`), so with requests in
    # flight pause_ms includes the rest of that step.
    in_flight: int = 0
    started_at: float = 0.0  # wall clock (time.time()) at the pause call: lines up with logs


class VllmSamplerEngine(SamplerEngine):
    """See the module docstring (a `CudaWeightSink` and a `ConcurrentSampler`)."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.4,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
        seed: int = 0,
        max_num_seqs: int = 256,
        attention_backend: str | None = "TRITON_ATTN",
        request_timeout_s: float = 1800.0,
        extra_engine_args: dict | None = None,
        lora: LoraServing | None = None,
        max_snapshots: int = 8,
        tp: int = 1,
        return_routed_experts: bool = False,
        routing_at_finish: bool = True,
    ) -> None:
        # tp > 1: vLLM's own worker processes on the actor's tp GPUs (its "mp" executor); the
        # default would pick Ray's executor inside our placement group and find no bundle free.
        parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
        routing = {"scheduler_cls": SCHEDULER_CLS}  # R3 records read once a request (`routing`)
        self.engine_kwargs = dict(
            model=str(model_path),
            skip_tokenizer_init=True,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            seed=seed,
            max_num_seqs=max_num_seqs,
            attention_backend=attention_backend,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=True,
            disable_log_stats=True,
            enable_return_routed_experts=return_routed_experts,
            **(routing if return_routed_experts and routing_at_finish else {}),
            **(parallel if tp > 1 else {}),
            **(lora.engine_args() if lora is not None else {}),
            **(extra_engine_args or {}),
        )
        self.returns_routed_experts = return_routed_experts
        self.lora = lora
        self.serves_adapters = lora is not None
        # LoRA engines: weight keys → adapters (the base weights stay as loaded).
        self._adapters = AdapterTable(max_snapshots) if lora is not None else None
        self.request_timeout_s = request_timeout_s
        self.sync_history: list[SyncRecord] = []
        self.evicted: set[str] = self._adapters.evicted if self._adapters is not None else set()
        self._live: tuple[str | None, int] = (BASE_KEY, 0)  # (key, version); replaced atomically
        self._layout: list[tuple[str, str, tuple[int, ...]]] | None = None
        self._closed = False
        self._running = 0  # requests added to vLLM and not finished (touched on the loop only)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        try:
            self._engine = self._wait(self._start(), START_TIMEOUT_S, "engine start")
        except BaseException:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    # -- loop plumbing ---------------------------------------------------------------------------

    async def _start(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Built on our loop so its output handler task lives there.
        self._open = asyncio.Event()  # admission gate, closed while a weight swap starts
        self._open.set()
        self._submitting = 0  # requests between the gate and vLLM's add_request returning
        self._swap_lock = asyncio.Lock()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs))

    def _wait(self, coro, timeout: float, what: str):
        if self._closed:
            coro.close()
            raise BackendError("the vllm sampler engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError as e:
            future.cancel()  # cancels the task; the request coroutine aborts its vLLM request
            raise BackendError(f"vllm sampler: {what} did not finish within {timeout:.0f} s") from e

    def close(self, timeout: float = 60.0) -> None:
        """Shut the engine and its loop down (bounded in time); further calls raise."""
        if self._closed:
            return
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown(timeout=timeout)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)

    # -- weights ---------------------------------------------------------------------------------

    def has_weights(self, key: str) -> bool:
        if self._adapters is not None:
            return self._adapters.has(key)
        return self._live[0] == key

    def version(self, key: str) -> int:
        """The version of weight set `key`; only the live key has one (LoRA: every key held)."""
        if self._adapters is not None:
            return self._adapters.version(key)
        live_key, live_version = self._live
        if live_key != key:
            raise KeyError(f"vllm sampler weights {key!r} are not live")
        return live_version

    def drop_weights(self, key: str) -> None:
        """Forget the name `key`; the loaded weights stay until the next `set_weights` (LoRA:
        its adapter is unloaded once no request runs on it)."""
        if self._adapters is not None:
            self._wait(self._drop_adapter(key), RPC_TIMEOUT_S, f"dropping adapter {key!r}")
            return
        self.evicted.discard(key)
        if key != BASE_KEY and self._live[0] == key:
            self._live = (None, self._live[1])

    def param_layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """`(vLLM name, dtype name, shape)` of every engine parameter (pack IPC weights to this)."""
        if self._layout is None:
            rows = self._wait(self._rpc("param_layout"), RPC_TIMEOUT_S, "param_layout")
            self._layout = [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in rows]
        return self._layout

    def weights_checksum(self) -> tuple[float, float]:
        """(sum, sum |x|) over the engine's parameters, float64 (for tests)."""
        total, absolute = self._wait(self._rpc("weights_checksum"), RPC_TIMEOUT_S, "checksum")
        return float(total), float(absolute)

    def worker_call(self, method: str, *args, timeout: float = RPC_TIMEOUT_S):
        """Call a `OneloopWorkerExtension` method on the engine's worker (blocking, bounded)."""
        return self._wait(self._rpc(method, *args), timeout, method)

    def open_weight_group(self, name: str, host: str, port: int, world_size: int, rank: int) -> str:
        """Join a trainer's NCCL weight group (both sides at once); returns the worker's GPU."""
        return str(self.worker_call("open_nccl_group", name, host, port, world_size, rank))

    async def _rpc(self, method: str, *args):
        return (await self._rpc_all(method, *args))[0]  # worker 0's answer

    async def _rpc_all(self, method: str, *args) -> list:
        """Every worker's answer (one per tensor-parallel rank; any failure raises)."""
        return await self._engine.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)

    def set_weights(
        self,
        key: str,
        weights: dict[str, np.ndarray] | CudaIpcWeights | NcclWeights | AdapterDir,
        version: int,
    ) -> None:
        if (self._adapters is not None) != isinstance(weights, AdapterDir):
            what = "serves LoRA adapters and takes no full-weight updates" if self._adapters else (
                "was started without LoRA and takes no adapters")  # fmt: skip
            raise RequestError(f"set_weights({key!r}): this vllm engine {what} (LoRA runs and full "
                               "fine-tuning of one base model need separate engines)")  # fmt: skip
        if isinstance(weights, AdapterDir):
            self._wait(
                self._install_adapter(key, version, weights),
                RPC_TIMEOUT_S,
                f"loading adapter {key!r} version {version}",
            )
            return
        if isinstance(weights, NcclWeights):
            method, args = "load_nccl_weights", (weights.to_wire(),)
            path = "nccl" if weights.into == "params" else "nccl-buffer"
            nbytes = weights.nbytes
        elif isinstance(weights, CudaIpcWeights):
            method = "load_ipc_weights"
            args: tuple = (weights.to_wire(),)
            path, nbytes = ("ipc" if weights.layout == "vllm" else "ipc-hf"), weights.nbytes
        elif isinstance(weights, dict):
            method, args, nbytes = "load_hf_weights", *hf_payload(weights)
            path = "hf"
        else:
            raise RequestError(
                f"set_weights({key!r}): weights must be a dict of Hugging Face "
                f"arrays, CudaIpcWeights or NcclWeights, got {type(weights).__name__}"
            )
        self._wait(
            self._swap(key, version, method, args, path, nbytes),
            DRAIN_TIMEOUT_S,
            f"weight update of {key!r} to version {version}",
        )

    async def _swap(self, key, version, method, args, path, nbytes) -> None:
        async with self._swap_lock:
            self._open.clear()
            try:
                await self._pending_submissions_done()
                same = self._live[0] == key
                mode = "keep" if same else "wait"
                in_flight, started_at = self._running, time.time()
                t0 = t1 = time.perf_counter()
                try:  # resume even when the pause, the load or our caller's wait fails
                    await self._engine.pause_generation(mode=mode, clear_cache=False)
                    t1 = time.perf_counter()
                    answers = await self._rpc_all(method, *args)  # every rank its shard
                    loaded = answers[0]
                except BaseException:
                    self._live = (None, self._live[1])  # maybe partly loaded: no key owns them
                    raise
                finally:
                    t2 = time.perf_counter()
                    await self._engine.resume_generation()
                    t3 = time.perf_counter()
                old = self._live[0]
                if old is not None and old != key:
                    self.evicted.add(old)
                self.evicted.discard(key)
                self._live = (key, version)
                self.sync_history.append(
                    SyncRecord(
                        key=key,
                        version=version,
                        path=path,
                        mode=mode,
                        bytes=nbytes,
                        pause_ms=1e3 * (t1 - t0),
                        load_ms=1e3 * (t2 - t1),
                        resume_ms=1e3 * (t3 - t2),
                        window_ms=1e3 * (t3 - t0),
                        transfer_ms=loaded.get("transfer_ms") if isinstance(loaded, dict) else None,
                        workers=len(answers),
                        in_flight=in_flight,
                        started_at=started_at,
                    )
                )
            finally:
                self._open.set()

    async def _pending_submissions_done(self) -> None:
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while self._submitting:
            if time.monotonic() > deadline:
                raise BackendError("vllm sampler: requests did not reach the engine in time")
            await asyncio.sleep(SUBMIT_POLL_S)

    # -- LoRA adapters ---------------------------------------------------------------------------

    async def _install_adapter(self, key: str, version: int, payload: AdapterDir) -> None:
        assert self._adapters is not None
        adapter = self._adapters.new(key, version, payload.path)
        t0 = time.perf_counter()
        try:  # load (and validate) now, so a bad adapter fails the publish, not a later sample
            added = await self._engine.add_lora(lora_request(adapter))
        except Exception as e:
            # vLLM reports a failed load in its engine core as a plain `Exception` carrying the
            # message (`_process_utility_output`); anything else (a dead engine) is not ours.
            if type(e) is not Exception and not isinstance(e, ValueError):
                raise
            raise RequestError(
                f"vllm refused the LoRA adapter of {key!r} ({payload.path}): {e}"
            ) from e
        if not added:  # ids are never reused, so False means it was not loaded
            raise BackendError(f"vllm did not load the LoRA adapter of {key!r} ({payload.path})")
        t1 = time.perf_counter()
        unload = self._adapters.install(adapter)
        await self._unload(unload)
        if adapter in unload:  # a newer version of `key` was installed meanwhile
            return
        ms = 1e3 * (t1 - t0)
        self.sync_history.append(
            SyncRecord(key=key, version=version, path="lora", mode="none", bytes=payload.nbytes,
                       pause_ms=0.0, load_ms=ms, resume_ms=0.0, window_ms=0.0)
        )  # fmt: skip

    def lora_ids(self) -> set[int]:
        """LoRA ids vLLM holds loaded now (tests check that replaced adapters get unloaded)."""
        return set(self._wait(self._engine.list_loras(), RPC_TIMEOUT_S, "list_loras"))

    async def _drop_adapter(self, key: str) -> None:
        assert self._adapters is not None
        await self._unload(self._adapters.drop(key))

    async def _unload(self, adapters: list[Adapter]) -> None:
        for adapter in adapters:
            await self._engine.remove_lora(adapter.lora_id)

    def _check_live(self, key: str) -> int:
        live_key, version = self._live
        if live_key == key:
            return version
        if key in self.evicted:
            raise RequestError(
                f"sampler weights {key!r} were replaced: the vllm sampler engine holds one "
                "weight set; snapshot clients of a fully fine-tuned model need "
                "sampler_engine=torch or LoRA"
            )
        if live_key is None:
            raise RequestError(
                f"sampler weights {key!r} are not loaded (the last weight update "
                "failed or dropped them); install them with set_weights"
            )
        raise RequestError(f"sampler has no weights named {key!r} (live: {live_key!r})")

    # -- generation ------------------------------------------------------------------------------

    def sample(self, key: str, request: SampleRequest) -> SampleOutput:
        return self._wait(self._sample(key, request), self.request_timeout_s, "sample")

    def submit_sample(self, key: str, request: SampleRequest) -> Future:
        """Like `sample`, but returns a future at once (await it with `asyncio.wrap_future`)."""
        if self._closed:
            raise BackendError("the vllm sampler engine is closed")
        coro = asyncio.wait_for(self._sample(key, request), self.request_timeout_s)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        if tokens.ndim != 1 or tokens.shape[0] < 1:
            raise RequestError(
                f"prompt_logprobs: tokens must be a non-empty 1-D array, got shape {tokens.shape}"
            )
        return self._wait(
            self._prompt_logprobs(key, tokens), self.request_timeout_s, "prompt_logprobs"
        )

    async def _prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,
            logprobs=None,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        out, _ = await self._generate(key, tokens, params)
        return prompt_logprob_array(out.prompt_logprobs, tokens)

    async def _sample(self, key: str, request: SampleRequest) -> SampleOutput:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if request.stop_strings:
            raise RequestError(
                f"sampling_params.stop: the vllm sampler engine runs without a tokenizer and "
                f"cannot match stop strings {list(request.stop_strings)[:3]}; pass stop token "
                "ids instead (or use sampler_engine=torch)"
            )
        if request.num_samples < 1 or request.max_tokens < 1:
            raise RequestError(
                f"num_samples and max_tokens must be >= 1, got "
                f"{request.num_samples} and {request.max_tokens}"
            )
        params = SamplingParams(
            n=request.num_samples,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=request.seed,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0 if request.include_prompt_logprobs else None,
            detokenize=False,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        out, version = await self._generate(key, request.prompt, params)
        sequences = [
            sequence(c, len(request.prompt), self.returns_routed_experts)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        if len(sequences) != request.num_samples:
            raise BackendError(
                f"vllm returned {len(sequences)} sequences, asked for {request.num_samples}"
            )
        prompt_lp = (
            prompt_logprob_array(out.prompt_logprobs, request.prompt)
            if request.include_prompt_logprobs
            else None
        )
        return SampleOutput(sequences=sequences, version=version, prompt_logprobs=prompt_lp)

    async def _generate(self, key: str, prompt: np.ndarray, params):
        """Admit (gate → live check → add_request), then wait for the final output."""
        from vllm.inputs.engine import tokens_input

        await self._open.wait()
        adapter, lora = None, None
        if self._adapters is not None:  # counted as running from here until it ends
            adapter = self._adapters.acquire(key)
            version = adapter.version if adapter is not None else 0
            lora = lora_request(adapter)
        else:
            version = self._check_live(key)
        try:
            engine_input = tokens_input([int(t) for t in prompt], cache_salt=f"{key}@v{version}")
            self._submitting += 1
            try:
                queue = await self._engine.add_request(
                    f"{key}-{uuid.uuid4().hex}", engine_input, params, lora_request=lora
                )
            except ValueError as e:
                raise RequestError(f"vllm rejected the request: {e}") from e
            finally:
                self._submitting -= 1
            self._running += 1
            try:
                while True:
                    out = queue.get_nowait() or await queue.get()
                    if out.finished:
                        return out, version
            except asyncio.CancelledError:
                await self._engine.abort(queue.request_id, internal=True)
                raise
            finally:
                self._running -= 1
                queue.close()
        finally:
            if self._adapters is not None:
                await self._unload(self._adapters.release(adapter))
