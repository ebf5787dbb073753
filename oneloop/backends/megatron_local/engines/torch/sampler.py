"""Sampler engine `torch`: transformers generation from token ids with per-token logprobs.

- Weight sets are named (`base`, one inflight set per training model, snapshots); the model holds
  one at a time and switches by `load_state_dict` (cheap at the sizes this engine serves).
- A request's `num_samples` sequences are one batch over the same prompt; row i draws from its own
  `torch.Generator` seeded from (`seed`, i): same seed ⇒ same tokens, and sample i does not depend
  on num_samples. Requests are never mixed into one batch, so a request's tokens do not depend on
  what else is queued.
- Returned logprobs are the model's raw (temperature 1, unfiltered) log-probabilities of the sampled
  tokens, the same quantity the trainer computes; temperature / top-k / top-p only shape the draw.
- Stops: `stop=None` stops on the model's EOS ids; token-id stops end on (and include) that token;
  string stops end on the token whose decoding completes the string (included).
"""

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, DynamicCache

from oneloop.backends.megatron_local.engines.base import (
    SampledArrays,
    SampleOutput,
    SamplerEngine,
    SampleRequest,
)
from oneloop.backends.megatron_local.engines.hf import (
    cache_kwarg,
    load_causal_lm,
    set_threads,
    token_logprobs,
    untie_embeddings,
)
from oneloop.errors import RequestError

BASE_KEY = "base"


class TorchSamplerEngine(SamplerEngine):
    """See the module docstring."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "float32",
        threads: int | None = None,
        max_snapshots: int = 8,
        device: str = "cpu",
    ) -> None:
        set_threads(threads)
        self.device = torch.device(device)
        self.model = untie_embeddings(load_causal_lm(model_path, dtype)).to(self.device).eval()
        self.cache_kwarg = cache_kwarg(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.max_snapshots = max_snapshots
        base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.weight_sets: OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self.weight_sets[BASE_KEY] = (base, 0)
        self.evicted: set[str] = set()
        self.serves_adapters = False  # merged weights only
        self.sync_history: list = []  # keeps no records of weight updates
        self.loaded_key = BASE_KEY

    # -- weights ---------------------------------------------------------------------------------

    def set_weights(self, key: str, weights: dict[str, np.ndarray], version: int) -> None:
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        expected = set(self.weight_sets[BASE_KEY][0])
        if set(tensors) != expected:
            extra, missing = set(tensors) - expected, expected - set(tensors)
            raise RequestError(
                f"weights for {key!r} do not match the sampler's model: "
                f"unexpected {sorted(extra)[:3]}, missing {sorted(missing)[:3]}"
            )
        self.weight_sets[key] = (tensors, version)
        self.weight_sets.move_to_end(key)
        self.evicted.discard(key)
        if self.loaded_key == key:
            self.loaded_key = ""  # force a reload on next use
        self._evict()

    def _evict(self) -> None:
        snapshots = [k for k in self.weight_sets if k.startswith("snapshot:")]
        while len(snapshots) > self.max_snapshots:
            oldest = snapshots.pop(0)
            del self.weight_sets[oldest]
            self.evicted.add(oldest)

    def drop_weights(self, key: str) -> None:
        if key != BASE_KEY:
            self.weight_sets.pop(key, None)

    def has_weights(self, key: str) -> bool:
        return key in self.weight_sets

    def version(self, key: str) -> int:
        """The version of weight set `key` (without loading it)."""
        return self.weight_sets[key][1]

    def _use(self, key: str) -> int:
        if key not in self.weight_sets:
            if key in self.evicted:
                raise RequestError(
                    f"sampler weights {key!r} were evicted to keep at most "
                    f"{self.max_snapshots} snapshots in memory; raise local.max_snapshots or "
                    "sample from a saved path (save_weights_for_sampler)"
                )
            raise RequestError(f"sampler has no weights named {key!r}")
        tensors, version = self.weight_sets[key]
        if self.loaded_key != key:
            self.model.load_state_dict(tensors, strict=True)
            self.loaded_key = key
        return version

    # -- generation ------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, key: str, request: SampleRequest) -> SampleOutput:
        version = self._use(key)
        n = request.num_samples
        prompt = torch.from_numpy(request.prompt.astype(np.int64)).to(self.device)
        seed = request.seed if request.seed is not None else int.from_bytes(np.random.bytes(7))
        generators = [self._generator(seed, row) for row in range(n)]
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompt[None, :], use_cache=True, **{self.cache_kwarg: cache})
        prompt_lp = None
        if request.include_prompt_logprobs:
            prompt_lp = self._prompt_logprobs_from(out.logits[0], prompt)
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].expand(n, -1)
        tokens = torch.zeros(n, request.max_tokens, dtype=torch.long)
        logprobs = torch.zeros(n, request.max_tokens, dtype=torch.float32)
        lengths = torch.full((n,), request.max_tokens, dtype=torch.long)
        done = torch.zeros(n, dtype=torch.bool)
        stop_reason = ["length"] * n
        stop_ids = set(request.stop_token_ids)
        position = prompt.shape[0]
        for step in range(request.max_tokens):
            chosen = self._draw(logits, request, generators)
            lp = token_logprobs(logits, chosen)
            tokens[:, step] = chosen.cpu()
            logprobs[:, step] = lp.cpu()
            for row in range(n):
                if done[row]:
                    continue
                if self._stops(int(chosen[row]), tokens[row, : step + 1], stop_ids, request):
                    done[row] = True
                    lengths[row] = step + 1
                    stop_reason[row] = "stop"
            if bool(done.all()) or step + 1 == request.max_tokens:
                break
            out = self.model(
                input_ids=chosen[:, None],
                use_cache=True,
                position_ids=torch.full((n, 1), position, device=self.device),
                **{self.cache_kwarg: cache},
            )
            logits = out.logits[:, -1, :]
            position += 1
        sequences = [
            SampledArrays(
                tokens=tokens[row, : lengths[row]].numpy().astype(np.int32),
                logprobs=logprobs[row, : lengths[row]].numpy().astype(np.float32),
                stop_reason=stop_reason[row],
            )
            for row in range(n)
        ]
        return SampleOutput(sequences=sequences, version=version, prompt_logprobs=prompt_lp)

    def _stops(
        self, token: int, generated: torch.Tensor, stop_ids: set[int], request: SampleRequest
    ) -> bool:
        if token in stop_ids:
            return True
        if request.stop_strings:
            # A window of tokens wide enough for the longest stop string (a byte-level token can
            # decode to less than one character); the string must be completed by this token.
            window = 4 * max(len(s) for s in request.stop_strings) + 8
            now = self.tokenizer.decode(generated[-window:].tolist())
            before = self.tokenizer.decode(generated[-window:-1].tolist())
            return any(s in now and s not in before for s in request.stop_strings)
        return False

    @staticmethod
    def _draw(
        logits: torch.Tensor, request: SampleRequest, generators: list[torch.Generator]
    ) -> torch.Tensor:
        logits = logits.float()
        if request.temperature == 0.0:
            return logits.argmax(dim=-1)
        scaled = logits / request.temperature
        if request.top_k > 0:
            kth = torch.topk(scaled, min(request.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if request.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= request.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
        probs = torch.softmax(scaled, dim=-1)
        rows = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
        return torch.cat(rows)

    def _generator(self, seed: int, row: int) -> torch.Generator:
        """Row `row`'s own stream: a request's i-th sample does not depend on num_samples."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed * 1_000_003 + row) % (2**63))
        return generator

    def _prompt_logprobs_from(self, logits: torch.Tensor, prompt: torch.Tensor) -> np.ndarray:
        scored = token_logprobs(logits[:-1], prompt[1:]).cpu().numpy().astype(np.float32)
        return np.concatenate([np.array([np.nan], np.float32), scored])

    @torch.no_grad()
    def prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        self._use(key)
        prompt = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
        logits = self.model(input_ids=prompt[None, :]).logits[0]
        return self._prompt_logprobs_from(logits, prompt)
