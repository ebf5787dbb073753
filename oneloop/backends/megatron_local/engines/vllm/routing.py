"""Routed experts (R3) read once per finished request: the vLLM scheduler our sampler engine runs.

vLLM 0.26 returns a request's routed experts (`enable_return_routed_experts`) in pieces: the
prompt's rows when its prefill completes, then one row per decode step, each piece sliced out of
the step's routing in the engine core, msgpack-encoded, decoded in the front-end process and
appended to the request's chunks there. At 256 requests decoding, that per-step, per-request work
is vLLM's step loop's bottleneck: 17.5 % of decode tokens/s on the reduced Qwen3-30B-A3B width with
CUDA graphs (README, `gpu_run.sh vllm_r3`, `benchmarks/r3prof`), where the issue asks for 5 %. With
this scheduler the record costs 2.6 % and -2.9 % (two runs, per-rep paired medians, README).

vLLM already keeps every computed position's routing in a CPU buffer indexed by KV-cache slot
(`RoutedExpertsManager`, written once a step by one fancy-index assignment). `RoutingAtFinish`
turns the per-step pieces off and instead reads a request's whole record from that buffer once,
when it finishes: rows `[routed_experts_prompt_start, num_tokens - 1)` (every fed position: the
last sampled token is never fed), through the request's own blocks, at the moment vLLM frees them,
in the same `update_from_output` call that emits the finished output, before the next step's
routing is stored. The front end receives one piece and concatenates it as before, so
`CompletionOutput.routed_experts` has the same shape and dtype as vLLM's own.

Where the two can differ: a request preempted and recomputed (KV-cache pressure) gets the routing
of its recomputation for the positions before the preemption, where vLLM's pieces keep the first
computation's. Both are routings the sampler really ran; the recomputed one is what the KV of every
later token was built with. A request preempted and finished in the same step (async scheduling)
is read through the blocks it held when it was preempted (kept for that case; their slots are only
rewritten by a later step's routing).

vLLM's extension point for this is its scheduler class (`scheduler_cls`, a qualified name the
engine-core process imports), so this is a subclass of vLLM's scheduler, the one place oneloop
inherits from a library class: `RoutingAtFinish(vllm_config=..., ...)` builds the variant of vLLM's
`AsyncScheduler` or `Scheduler` that the engine's async-scheduling setting asks for. vLLM's own
per-step pieces stay available: `VllmSamplerEngine(routing_at_finish=False)`.
"""

import functools
from typing import Any

SCHEDULER_CLS = "oneloop.backends.megatron_local.engines.vllm.routing.RoutingAtFinish"
"""The qualified name passed as vLLM's `scheduler_cls` (imported in the engine-core process)."""


class RoutingAtFinish:
    """A factory in the shape of a scheduler class: see the module docstring."""

    def __new__(cls, *args: Any, vllm_config: Any, **kwargs: Any) -> Any:
        asynchronous = bool(vllm_config.scheduler_config.async_scheduling)
        return scheduler_classes()[asynchronous](*args, vllm_config=vllm_config, **kwargs)


@functools.cache
def scheduler_classes() -> dict[bool, type]:
    """{async_scheduling: the scheduler class}, built on first use (vLLM is imported only where it
    runs); subclass these to extend the scheduler further (the GPU test checks against vLLM's
    own pieces that way)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    def build(base: type) -> type:
        class Routing(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # vLLM's flag gates its block-id snapshot every step and its per-step pieces;
                # its slot buffer (`routed_experts_mgr`) is built and written regardless.
                self._routing_on = bool(self.enable_return_routed_experts)
                self.enable_return_routed_experts = False
                self._in_update = False
                self._finished_routing: dict[str, Any] = {}
                self._preempted_blocks: dict[str, list[int]] = {}

            def _preempt_request(self, request: Any, timestamp: float) -> None:
                if self._routing_on:
                    self._preempted_blocks[request.request_id] = self._block_ids(request)
                super()._preempt_request(request, timestamp)

            def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
                preempted = self._preempted_blocks.pop(request.request_id, None)
                if self._routing_on and self._in_update:  # finished by this step's output
                    blocks = self._block_ids(request) or preempted or []
                    params = request.sampling_params
                    start = getattr(params, "routed_experts_prompt_start", None) or 0
                    self._finished_routing[request.request_id] = self.routed_experts_mgr.get(
                        blocks, request.num_tokens - 1, token_start=start
                    )
                return super()._free_request(request, *args, **kwargs)

            def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
                self._in_update = True
                try:
                    outputs = super().update_from_output(scheduler_output, model_runner_output)
                finally:
                    self._in_update = False
                self._attach_routing(outputs)
                return outputs

            def _attach_routing(self, outputs: dict[int, Any]) -> None:
                """Put each finished request's record on its output of this step."""
                if not self._finished_routing:
                    return
                for engine_outputs in outputs.values():
                    for output in engine_outputs.outputs:
                        routing = self._finished_routing.pop(output.request_id, None)
                        if routing is not None:
                            output.routed_experts = routing
                self._finished_routing.clear()  # finished without an output: nothing to send

            def _block_ids(self, request: Any) -> list[int]:
                gid = self.routed_experts_mgr.attn_gid
                return list(self.kv_cache_manager.get_block_ids(request.request_id)[gid])

        Routing.__name__ = Routing.__qualname__ = f"RoutingAtFinish{base.__name__}"
        return Routing

    return {True: build(AsyncScheduler), False: build(Scheduler)}
