"""The backend section of every oneloop config: which backend, and how to reach or build it.

Validated when parsed (pydantic, unknown keys rejected); errors name the dotted path of the field.
A sub-config is only read by its backend: `local` by `megatron_local`, `tinker` by `tinker_remote`.
"""

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from oneloop.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _changed_fields(settings: BaseModel, defaults: BaseModel) -> list[str]:
    """Dotted names of the fields of `settings` that differ from `defaults` (nested: `a.b`)."""
    changed = []
    for name in type(settings).model_fields:
        value, default = getattr(settings, name), getattr(defaults, name)
        if isinstance(value, BaseModel):
            changed += [f"{name}.{sub}" for sub in _changed_fields(value, default)]
        elif value != default:
            changed.append(name)
    return changed


class MegatronSpeedSettings(_Strict):
    """Layer spec and speed switches of the `megatron` engine (`megatron.speed` has the measured
    reason for each; all exact up to bf16 rounding). Defaults: the measured best."""

    fused_logprobs: bool = True
    """Target logprobs from the hidden states, chunked (no fp32 full-vocabulary logits)."""
    compile_logprobs: bool = True
    """The fused logprob chunk as torch.compile kernels (off: eager torch)."""
    triton_logprobs: bool = False
    """With compile_logprobs: two Triton kernels over all rows instead (opt-in until measured)."""
    logprob_chunk_rows: int = Field(default=2048, ge=1)
    """Rows of [rows, vocab] work per fused-logprob chunk (eager and Inductor kernels)."""
    bf16_norms: bool = True
    """RMSNorm weights in the model dtype (torch's fused RMSNorm kernel)."""
    swiglu_fusion: bool = True
    """megatron-core's SwiGLU fusion (torch.compile kernels)."""
    fused_adam: bool = True
    """torch's single-kernel fused AdamW in place of the foreach one."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient"] = "auto"
    """torch SDPA backend of the core attention; auto = torch's choice."""
    fused_rope: bool | Literal["auto"] = "auto"
    """RoPE inside the SDPA core attention as one compiled kernel per q and k; auto = where it
    applies (local spec, full-dimension RoPE without scaling)."""
    layer_spec: Literal["auto", "te", "local"] = "auto"
    """Layer spec: `te` = TransformerEngine's (refused where TE is not importable, with LoRA or
    CP), `local` = megatron-core's local spec with SDPA attention, `auto` = TE where usable."""
    grouped_experts: bool = True
    """MoE models: each layer's experts as two grouped GEMMs (off: megatron's per-expert loop)."""
    gather_dispatch: bool = True
    """MoE models: tokens to and from the experts by gathers (off: megatron's scatter-add)."""


class MegatronSettings(_Strict):
    """Settings of the `megatron` trainer engine (GPU)."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size: every rank of a group of more than one is a Ray actor of one GPU in
    the trainer's placement group (`gpus_per_trainer` = dp · tp · pp · cp); LoRA adapters are split
    like their base linears (`megatron.parallel.lora_tp`), with pp = cp = 1."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size: the decoder layers split evenly over pp stages (pp must divide
    num_hidden_layers), run by megatron-core's 1F1B schedule over the token-budget micro-batches
    (`megatron.parallel.pp`); combines with tp, dp and ep (`gpus_per_trainer` = dp · tp · pp · cp);
    full fine-tuning only (LoRA needs pp = 1)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel size: each sequence split over cp ranks (Megatron's 2·cp-chunk layout, K/V
    all-gathered; no TE needed); ranks = tp × cp GPUs; not with pp > 1 or LoRA; MoE and the
    hybrids at tp = 1 (a Gated DeltaNet splits its heads over the cp ranks)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE models): each MoE layer's experts split over ep ranks carved out
    of each pipeline stage's tp · cp · dp ranks (under tp > 1 every expert stays whole, with
    sequence parallelism), tokens dispatched all-to-all."""
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0.0)
    """MoE load-balancing aux loss coefficient (0 = off, the RL default: it would pull the policy
    away from the sampler's routing)."""
    moe_z_loss_coeff: float = Field(default=0.0, ge=0.0)
    """MoE router z-loss coefficient (0 = off)."""
    dp: int | None = Field(default=None, ge=1)
    """Data-parallel size: replicas of the tp × pp × cp model, each call's datums split over them
    by token count, gradients summed by Megatron's DDP, the distributed optimizer sharded over them;
    None = local.gpus_per_trainer / (tp · pp · cp), at least 1."""
    placement_strategy: Literal["auto", "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "auto"
    """Ray placement strategy of the group's rank actors (one bundle per rank); auto = STRICT_PACK
    when the group fits one node, else PACK (TP × CP blocks on one node, DP replicas span nodes)."""
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer (fp32 main params sharded over data-parallel ranks)."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation: `full` keeps only each decoder layer's input from the forward
    and recomputes the layer during the backward (megatron-core's full, uniform recompute, one
    layer per checkpoint), so a long trajectory's activations take one layer's worth plus the
    layer inputs, for about one more forward of compute; the results are the same."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer state (fp32 main params, Adam moments) and the AdamW update of every
    parameter on the CPU (`megatron.offload`): ~12 GPU bytes a parameter saved, step time spent;
    needs bf16 trained weights (no LoRA), the distributed optimizer and tp = pp = cp = 1."""
    speed: MegatronSpeedSettings = MegatronSpeedSettings()
    """Layer spec (TransformerEngine or local) and speed switches (`local.megatron.speed.*`)."""


class VllmSettings(_Strict):
    """Settings of the `vllm` sampler engine (GPU)."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size of one engine: its GPUs (whole ones, on one node: one Ray placement
    group) and vLLM's `tensor_parallel_size`; weights reach every worker through the object store
    (`local.weight_sync` cuda_ipc / nccl write a single worker's layout: tp = 1 only)."""
    gpu_memory_utilization: float = Field(default=0.4, gt=0, le=1)
    """Fraction of GPU memory vLLM takes (weights + KV cache); keep < 0.5 beside a trainer."""
    max_model_len: int = Field(default=4096, gt=0)
    """Longest prompt + completion in tokens."""
    max_num_seqs: int = Field(default=256, gt=0)
    """Sequences one engine step may batch."""
    enforce_eager: bool = False
    """Skip CUDA graphs and compilation (faster start, slower decode). Eager, vLLM JIT-compiles a
    Triton kernel whenever a batch reaches a new shape (0.3-0.7 s each on the H200, MoE), and an
    in-flight weight sync's pause waits for that step: 0.9-1.6 s pauses measured vs 25-28 ms."""
    attention_backend: str | None = "TRITON_ATTN"
    """vLLM attention backend name; None = vLLM's choice (needs the flash-attention kernels)."""
    return_routed_experts: bool | None = None
    """Rollout routing replay's record: vLLM returns, per sampled sequence, the experts each MoE
    layer routed each position to (`enable_return_routed_experts`), for `algo.routing_replay`.
    None = on for mixture-of-experts models; false = off (R3 is then refused); true on a dense
    model is refused."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = None
    """LoRA runs: largest adapter rank the engine serves (vLLM's allowed ranks); None = the rank
    of the first LoRA client of the base model, rounded up (LoRA off if the first is not LoRA)."""
    max_loras: int = Field(default=4, ge=1)
    """LoRA runs: distinct adapters one batch may mix (snapshots and the inflight adapter)."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """LoRA runs: adapters kept in host memory (>= max_loras); None = max(max_loras,
    local.max_snapshots + 2): every snapshot plus the inflight adapter and the one it replaces."""

    @model_validator(mode="after")
    def _cpu_loras_hold_a_batch(self) -> "VllmSettings":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        return self


class LocalBackendConfig(_Strict):
    """How the local (Ray) backend builds its engines."""

    trainer_engine: Literal["torch", "megatron"] = "torch"
    """Trainer engine: `torch` (transformers, CPU or GPU) or `megatron` (megatron-core, GPU)."""
    sampler_engine: Literal["torch", "vllm"] = "torch"
    """Sampler engine: `torch` (transformers generation) or `vllm` (GPU)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of both engines."""
    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    """Token budget (padded tokens) of one trainer micro-batch on one GPU (at megatron cp = C a GPU
    holds 1/C of each sequence: a micro-batch then spans C × this many sequence tokens)."""
    torch_threads: int | None = Field(default=None, gt=0)
    """torch intra-op threads per actor; None = every core of the host."""
    samplers_per_model: int = Field(default=1, gt=0)
    """Sampler engines per base model; requests are routed session-affine (a trajectory's turns
    go to one engine) and every weight sync reaches all of them."""
    max_snapshots: int = Field(default=8, gt=0)
    """Snapshot weight sets a sampler keeps in memory (count); older ones are evicted, and requests
    for them then fail clearly."""
    ray_address: str | None = None
    """Address of an existing Ray cluster (`auto`: the one `ray start` runs on this node, as
    `scripts/cluster/` starts it); None starts a local one (`ray.init`)."""
    ray_num_cpus: int | None = Field(default=None, gt=0)
    """CPUs a locally started Ray advertises; None = Ray's default (the host's cores)."""
    max_lora_rank: int = Field(default=256, gt=0)
    """Largest LoRA rank this deployment accepts (rank 0 = full fine-tuning)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the `torch` engines run; the `megatron` and `vllm` engines always run on CUDA."""
    gpus_per_trainer: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves per trainer actor (0.5 + 0.5 colocates trainer and sampler on one GPU)."""
    gpus_per_sampler: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves per sampler actor."""
    weight_sync: Literal["auto", "object_store", "cuda_ipc", "nccl"] = "auto"
    """Trainer → sampler weights: numpy through Ray's object store, CUDA IPC into the vLLM
    engine's parameter storage (trainer and sampler on the same GPU), or NCCL into that storage
    (another GPU); auto = for vllm with a CUDA trainer, cuda_ipc or nccl by the actors' GPUs."""
    megatron: MegatronSettings = MegatronSettings()
    """Settings of the megatron trainer engine."""
    vllm: VllmSettings = VllmSettings()
    """Settings of the vllm sampler engine."""

    @model_validator(mode="after")
    def _engine_settings_need_their_engine(self) -> "LocalBackendConfig":
        for section, knob, engine in (
            ("megatron", "trainer_engine", "megatron"),
            ("vllm", "sampler_engine", "vllm"),
        ):
            settings = getattr(self, section)
            changed = _changed_fields(settings, type(settings)())
            if getattr(self, knob) != engine and changed:
                raise ValueError(
                    f"local.{section}.{changed[0]} configures the {engine} engine, but "
                    f"{knob}={getattr(self, knob)!r} (nothing would read it): set {knob}: "
                    f"{engine}, or drop local.{section}"
                )
        return self

    @model_validator(mode="after")
    def _vllm_tp_whole_gpus(self) -> "LocalBackendConfig":
        tp = self.vllm.tp
        if tp == 1:
            return self
        if self.weight_sync in ("cuda_ipc", "nccl"):
            raise ValueError(
                f"local.weight_sync={self.weight_sync} writes one vLLM worker's parameter layout, "
                f"but local.vllm.tp={tp} shards each engine over {tp} workers: use auto or "
                "object_store (every worker loads its shard), or local.vllm.tp=1"
            )
        if self.gpus_per_sampler not in (0, tp):
            raise ValueError(
                f"local.gpus_per_sampler={self.gpus_per_sampler:g}: a vllm engine of "
                f"local.vllm.tp={tp} holds {tp} whole GPUs on one node; set "
                f"local.gpus_per_sampler={tp} (or leave it 0)"
            )
        return self

    @model_validator(mode="after")
    def _gpu_sync_needs_vllm(self) -> "LocalBackendConfig":
        if self.weight_sync in ("cuda_ipc", "nccl") and self.sampler_engine != "vllm":
            raise ValueError(
                f"weight_sync={self.weight_sync} writes into the vLLM engine's parameters: it "
                f"needs sampler_engine=vllm (got {self.sampler_engine!r}); use auto or object_store"
            )
        return self


class TinkerBackendConfig(_Strict):
    """How to reach a Tinker service (Thinking Machines' or any server speaking its protocol)."""

    base_url: str | None = None
    """Service URL; None = the SDK's default (TINKER_BASE_URL or Thinking Machines' service)."""
    api_key: str | None = Field(default=None, repr=False)
    """API key; None = the SDK reads TINKER_API_KEY."""
    max_retries: int = Field(default=5, ge=0)
    """Retries of a failed request (connection errors, 5xx, 429) before it is an error."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Per-request HTTP timeout in seconds."""


class BackendConfig(_Strict):
    """Selects and configures the backend `connect` returns a ServiceClient for."""

    backend: Literal["local", "tinker"] = "local"
    """`local` = Ray cluster of our engines; `tinker` = the official SDK at `tinker.base_url`."""
    run_dir: Path = Path("runs/backend")
    """Local backend: directory under which `tinker://<run>/...` checkpoints are stored."""
    models: dict[str, Path] = Field(default_factory=dict)
    """Local backend: base-model name -> local Hugging Face directory (a name that is a directory
    works too)."""
    local: LocalBackendConfig = LocalBackendConfig()
    """Settings of the local backend."""
    tinker: TinkerBackendConfig = TinkerBackendConfig()
    """Settings of the remote (tinker) backend."""


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted path of the offending key."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in (prefix, *item["loc"]) if part != "")
        lines.append(f"{path or '<root>'}: {item['msg']} (got {item.get('input')!r})")
    return "; ".join(lines)


def parse_backend_config(raw: dict, prefix: str = "backend") -> BackendConfig:
    """Validate a mapping into a BackendConfig; errors are ConfigError naming dotted paths."""
    try:
        return BackendConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, prefix)) from None


BACKEND_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def read_backend_file(path: Path, flag: str = "--backend-config") -> dict[str, Any]:
    """The backend section in a YAML or JSON file, as a mapping: either the section itself
    (`backend: local`, `models: ...`, `local: ...`) or a file wrapped in `backend:` (the section
    as it appears in a full oneloop config). Every failure is one ConfigError line naming the
    file: a suffix other than .yaml/.yml/.json, a missing or unreadable file, a parse error, or a
    top level that is not a mapping."""
    where = f"{flag} {path}"
    if path.suffix.lower() not in BACKEND_FILE_SUFFIXES:
        raise ConfigError(f"{where}: expected a .yaml, .yml or .json file (the backend section)")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ConfigError(f"{where}: cannot read it ({reason})") from None
    try:
        if path.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except ValueError as error:  # json.JSONDecodeError
        raise ConfigError(f"{where}: not valid JSON ({error})") from None
    except Exception as error:  # yaml.YAMLError
        first = " ".join(str(error).split())
        raise ConfigError(f"{where}: not valid YAML ({first})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: expected a mapping (the backend section), got {type(raw).__name__}"
        )
    if isinstance(raw.get("backend"), dict):  # wrapped: `backend: {backend: local, ...}`
        if len(raw) > 1:
            others = ", ".join(sorted(str(k) for k in raw if k != "backend"))
            raise ConfigError(
                f"{where}: a file wrapped in `backend:` holds nothing else (also found: {others})"
            )
        raw = raw["backend"]
    return raw


def check_model_dirs(config: BackendConfig, prefix: str = "backend") -> None:
    """Every `models:` entry of the local backend is a Hugging Face model directory (has a
    config.json); else one ConfigError line naming the field and the path. Checked at startup,
    so a typo is not first met as a client's "Repo id must be in the form..." error."""
    if config.backend != "local":
        return
    for name, path in config.models.items():
        field = f"{prefix}.models.{name}"
        if not path.is_dir():
            raise ConfigError(
                f"{field}: {path} is not a directory (expected a local Hugging "
                "Face model directory)"
            )
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{field}: {path} has no config.json (expected a local Hugging "
                "Face model directory)"
            )
