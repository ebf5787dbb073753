"""Several sampler engines for one base model, and session-affine routing of requests over them.

An agent's trajectory is a chain of `sample` calls whose prompts extend each other (turn k's prompt
is turn k-1's prompt, its completion and the tool results). Sending every turn of a trajectory to
the engine that served the previous one keeps its prefix in that engine's KV cache; spreading new
trajectories evenly keeps the engines equally busy. The Tinker `sample` call carries no session id,
so the router recognises a session by its prompt:

- a prompt is cut into blocks of `block_tokens`; block i's key is a hash of tokens [0, (i+1)·block)
  (chained, so a key names a whole prefix), plus one key for the whole prompt;
- every key is remembered with the engine it first went to; the key of a prompt's last full block
  and its whole-prompt key are its *frontier*: where a continuation of that prompt branches off;
- a request whose deepest known key is a frontier continues that session: same engine (turn k+1
  extends turn k's prompt, and the n samples of a group repeat the same first prompt). A request
  that only shares an inner prefix with earlier ones (a system prompt) or nothing starts a session:
  its engine is a hash of the whole prompt modulo the engine count, so copies of the router in other
  processes (sampling clients are pickled into trial workers) agree and sessions spread evenly.

Memory is bounded: the least recently used keys are forgotten beyond `capacity`.
"""

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK_TOKENS = 64
CAPACITY = 1 << 16  # remembered prefix keys per router copy (~100 bytes each)


def _prefix_keys(tokens: np.ndarray, block: int) -> list[bytes]:
    """Key of every full block's prefix, then (if the prompt does not end on a block) the whole
    prompt's; chained blake2b, 8 bytes each."""
    data = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    step = block * 8
    keys, digest = [], b""
    for start in range(0, len(data), step):
        digest = hashlib.blake2b(digest + data[start : start + step], digest_size=8).digest()
        keys.append(digest)
    return keys


class PrefixRouter:
    """Thread-safe; see the module docstring. `route(tokens)` → engine index."""

    def __init__(
        self, engines: int, block_tokens: int = BLOCK_TOKENS, capacity: int = CAPACITY
    ) -> None:
        if engines < 1 or block_tokens < 1 or capacity < 1:
            raise ValueError(
                f"PrefixRouter: engines, block_tokens and capacity must be >= 1, got "
                f"{engines}, {block_tokens}, {capacity}"
            )
        self.engines = engines
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, list] = OrderedDict()  # key → [engine, is frontier]
        self.sessions = [0] * self.engines  # sessions started per engine (this copy)
        self.continued = 0  # requests routed as a continuing session

    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in ("engines", "block_tokens", "capacity")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def route(self, tokens: np.ndarray) -> int:
        if self.engines == 1 or len(tokens) == 0:
            return 0
        keys = _prefix_keys(tokens, self.block_tokens)
        frontier = {keys[-1]}
        if len(tokens) >= self.block_tokens:
            frontier.add(keys[len(tokens) // self.block_tokens - 1])
        with self._lock:
            deepest = next((k for k in reversed(keys) if k in self._known), None)
            if deepest is not None and self._known[deepest][1]:
                engine = self._known[deepest][0]
                self.continued += 1
            else:
                engine = int.from_bytes(keys[-1]) % self.engines
                self.sessions[engine] += 1
            for key in keys:
                entry = self._known.setdefault(key, [engine, False])
                entry[1] = entry[1] or key in frontier
                self._known.move_to_end(key)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)
        return engine


@dataclass
class SamplerPool:
    """The sampler actors of one base model and the router in front of them (picklable)."""

    actors: list[Any]
    router: PrefixRouter = field(init=False)

    def __post_init__(self) -> None:
        self.router = PrefixRouter(len(self.actors))

    def route(self, tokens: np.ndarray) -> tuple[int, Any]:
        index = self.router.route(tokens)
        return index, self.actors[index]
