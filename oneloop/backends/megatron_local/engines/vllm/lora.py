"""LoRA runs on the `vllm` sampler: adapters served as vLLM LoRA modules instead of merged weights.

Owns the vLLM-specific part (this module never imports vLLM, so CI tests it on CPU); which runs
serve adapters and whether a client fits an engine is the backend's policy (`lora_serving.py`):
- what vLLM accepts: LoRA ranks (`VLLM_LORA_RANKS`, `vllm_lora_rank`) and targets;
- the LoRA engine arguments a vLLM engine starts with (`LoraServing`, `lora_serving`);
- `AdapterTable`, the engine's bookkeeping: weight key → adapter (a unique vLLM LoRA int id and
  name per key + version), reference counts of running requests, and which adapters may be
  unloaded. vLLM keys prefix-cache blocks by the request's LoRA (`lora_request.lora_name` in
  `vllm/v1/core/kv_cache_utils.py::_gen_lora_extra_hash_keys`; older releases used
  `lora_int_id`), so both are unique per key + version and no request ever reuses KV computed
  under another adapter; the engine salts the cache per key + version as well.
The `set_weights` payload of the adapter path is `engines.base.AdapterDir` (a PEFT directory).

Why no pause on an adapter swap: each request carries its own `LoRARequest`, so requests already
running finish on the adapter they started with while new ones take the new one; the old adapter
is unloaded when its last request finishes.

Checked against vLLM 0.26.0's own source (the wheel the device installs): `LoRAConfig`'s
`MaxLoRARanks`; `LoRARequest` (id > 0, equality by name); the LRU worker manager loads any
adapter a scheduled request names from its `lora_path` (so one pushed out of the host cache by
`max_cpu_loras` comes back) and `remove_lora` drops it from that cache; `lm_head` is a LoRA target
only for models that declare it in `embedding_modules`. The prefix-cache key is from vLLM's
`kv_cache_utils.py` as stored upstream (that file is not in the part of the wheel kept here).
"""

import itertools
from dataclasses import dataclass, field

from oneloop.errors import CapabilityError, RequestError

# vLLM 0.26 `LoRAConfig.max_lora_rank` accepts exactly these ranks (`MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoRA targets vLLM serves for the dense families we train (Qwen3, Llama): its LoRA layers wrap
# linear layers only (`get_supported_lora_modules`); these models declare no embedding modules, so
# an adapter on `lm_head` / `embed_tokens` is refused by vLLM's loader.
VLLM_LORA_TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
BASE_KEY = "base"
SNAPSHOT_PREFIX = "snapshot:"


def vllm_lora_rank(rank: int, what: str = "lora rank") -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise CapabilityError(
        f"{what}={rank} exceeds the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
        "use a smaller rank or sampler_engine=torch"
    )


@dataclass(frozen=True)
class LoraServing:
    """LoRA engine arguments of one vLLM engine."""

    max_rank: int  # one of VLLM_LORA_RANKS
    max_loras: int  # adapters one batch may mix (GPU slots)
    max_cpu_loras: int  # adapters kept loaded in host memory (>= max_loras)

    def __post_init__(self) -> None:
        if self.max_rank not in VLLM_LORA_RANKS:
            raise CapabilityError(
                f"max_lora_rank={self.max_rank}: vLLM accepts one of {list(VLLM_LORA_RANKS)}"
            )
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise CapabilityError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}) >= 1"
            )

    def engine_args(self) -> dict:
        return dict(
            enable_lora=True,
            max_lora_rank=self.max_rank,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
        )


def lora_serving(
    rank: int, max_loras: int, max_cpu_loras: int | None, max_snapshots: int
) -> LoraServing | None:
    """LoRA engine arguments for capacity `rank` (None when 0). By default the host keeps every
    snapshot a sampler may hold plus the inflight adapter and the one it is replacing."""
    if rank == 0:
        return None
    cpu = max_cpu_loras if max_cpu_loras is not None else max(max_loras, max_snapshots + 2)
    return LoraServing(max_rank=rank, max_loras=max_loras, max_cpu_loras=cpu)


@dataclass(frozen=True)
class Adapter:
    """One installed adapter: what a request's `LoRARequest` is built from."""

    key: str
    version: int
    lora_id: int  # vLLM's lora_int_id, > 0, never reused
    name: str  # vLLM's lora_name, unique per key + version (keys its prefix-cache blocks)
    path: str


@dataclass
class AdapterTable:
    """Weight keys → adapters, with reference counts of running requests.

    Not thread-safe: the engine calls it from its event loop only. `install`, `release` and
    `drop` return the adapters that may now be unloaded from vLLM (no key holds them and no
    request runs on them); the caller unloads them.
    """

    max_snapshots: int
    live: dict[str, Adapter] = field(default_factory=dict)
    running: dict[int, int] = field(default_factory=dict)  # lora id → requests running on it
    retired: dict[int, Adapter] = field(default_factory=dict)  # replaced, requests still running
    evicted: set[str] = field(default_factory=set)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new(self, key: str, version: int, path: str) -> Adapter:
        """A fresh adapter (unique id and name) for `key` at `version`; not yet live."""
        if key == BASE_KEY:
            raise RequestError(f"weight key {key!r} is the base model; it takes no adapter")
        lora_id = next(self._ids)
        return Adapter(key, version, lora_id, f"{key}@v{version}#{lora_id}", path)

    def install(self, adapter: Adapter) -> list[Adapter]:
        """Make `adapter` the one `adapter.key` samples with; evict snapshots over the limit.
        Versions only move forward: an adapter older than the key's is returned for unloading
        instead (two publishes of one key that finished loading out of order)."""
        current = self.live.get(adapter.key)
        if current is not None and current.version > adapter.version:
            return [adapter]
        unload = self._retire(self.live.pop(adapter.key, None))
        self.live[adapter.key] = adapter
        self.evicted.discard(adapter.key)
        snapshots = [k for k in self.live if k.startswith(SNAPSHOT_PREFIX)]
        for oldest in snapshots[: max(len(snapshots) - self.max_snapshots, 0)]:
            unload += self._retire(self.live.pop(oldest))
            self.evicted.add(oldest)
        return unload

    def has(self, key: str) -> bool:
        return key == BASE_KEY or key in self.live

    def version(self, key: str) -> int:
        if key == BASE_KEY:
            return 0
        adapter = self.live.get(key)  # one read: other threads may ask while the loop installs
        if adapter is None:
            raise KeyError(f"vllm sampler has no adapter for {key!r}")
        return adapter.version

    def acquire(self, key: str) -> Adapter | None:
        """The adapter a new request on `key` runs with (None = the base model), counted as
        running until `release`."""
        if key == BASE_KEY:
            return None
        adapter = self.live.get(key)
        if adapter is None:
            if key in self.evicted:
                raise RequestError(
                    f"sampler adapter {key!r} was evicted to keep at most {self.max_snapshots} "
                    "snapshots; raise local.max_snapshots or sample from a saved path "
                    "(save_weights_for_sampler)"
                )
            raise RequestError(f"sampler has no adapter named {key!r}")
        self.running[adapter.lora_id] = self.running.get(adapter.lora_id, 0) + 1
        return adapter

    def release(self, adapter: Adapter | None) -> list[Adapter]:
        """A request that `acquire`d `adapter` ended (finished, failed or cancelled)."""
        if adapter is None:
            return []
        left = self.running[adapter.lora_id] - 1
        if left:
            self.running[adapter.lora_id] = left
            return []
        del self.running[adapter.lora_id]
        retired = self.retired.pop(adapter.lora_id, None)
        return [retired] if retired is not None else []

    def drop(self, key: str) -> list[Adapter]:
        """Forget `key` (no-op if absent or the base model)."""
        self.evicted.discard(key)
        return self._retire(self.live.pop(key, None)) if key != BASE_KEY else []

    def _retire(self, adapter: Adapter | None) -> list[Adapter]:
        if adapter is None:
            return []
        if self.running.get(adapter.lora_id):
            self.retired[adapter.lora_id] = adapter
            return []
        return [adapter]

    def loaded(self) -> set[int]:
        """LoRA ids that should be loaded in vLLM now (live or still running)."""
        return {a.lora_id for a in self.live.values()} | set(self.retired)
