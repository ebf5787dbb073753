"""The training run's one typed config: parsed from YAML plus dotted CLI overrides, validated once.

`load_config(path, overrides)` reads a YAML file (or the name of a preset shipped in the package,
`oneloop/loop/presets/`, found through `importlib.resources` so an installed wheel has them too),
applies `a.b.c=value` overrides (values parsed as YAML scalars), validates with pydantic (unknown
keys rejected) and raises `ConfigError` naming the dotted path of every bad key. A mode is on when
its sub-config is set (`sft`, `eval`, `checkpoint`). The same file runs on both backends.
"""

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from oneloop.backends.config import BackendConfig, format_validation_error
from oneloop.errors import ConfigError

PRESETS_PACKAGE = "oneloop.loop"
"""The package whose `presets/` folder holds the shipped `*.yaml` presets (package data)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    base_model: str = "oneloop/tiny-qwen3"
    """Base model name (the backend resolves it; local: backend.models or a path)."""
    lora_rank: int = Field(default=16, ge=0)
    """LoRA rank; 0 = full fine-tuning (local backend only)."""
    seed: int = 0
    """LoRA initialisation seed."""
    train_unembed: bool = True
    """LoRA on the LM head too (Tinker's default); the vllm sampler cannot serve it: set false."""


class DemoTasksConfig(_Strict):
    n_train: int = Field(default=64, ge=1)
    """Training tasks to generate (count)."""
    n_eval: int = Field(default=32, ge=1)
    """Held-out tasks to generate (count)."""
    seed: int = 0
    """Seed of the task generator."""
    difficulties: list[Literal["easy", "medium", "hard"]] = ["easy", "medium"]
    """Difficulty levels to cycle through."""
    wrong_tool_fraction: dict[Literal["+", "-", "*", "/"], Annotated[float, Field(ge=0, le=1)]] = {}
    """Share of the demonstrations (`sft.data: demo`), by the question's last operator, that call
    the inverse tool (deliberately imperfect SFT for RL to correct; see
    `oneloop.agents.demo_tasks.demonstrations`); {} = none."""
    n_demonstrations: int | None = Field(default=None, ge=1)
    """Tasks drawn for the demonstrations of `sft.data: demo` only, apart from the training and
    held-out tasks (count); null = demonstrate the training tasks themselves."""


class TasksConfig(_Strict):
    dir: Path | None = None
    """Harbor task directories under `<dir>/train/*` and `<dir>/eval/*`; None = generate the demo
    family."""
    demo: DemoTasksConfig = DemoTasksConfig()
    """The generated demo task family (used when `dir` is None)."""


class AgentConfig(_Strict):
    max_turns: int = Field(default=8, ge=1)
    """Most sample calls per episode (count)."""
    max_tokens_per_turn: int = Field(default=128, ge=1)
    """Cap on tokens sampled per turn (tokens)."""
    context_window: int = Field(default=2048, ge=16)
    """Most tokens one trajectory may hold (tokens)."""
    tool_timeout_s: float = Field(default=30.0, gt=0)
    """Limit on one MCP tool call (seconds)."""
    tool_result_max_chars: int = Field(default=2000, ge=16)
    """Longest tool result shown to the model (characters; head/tail truncation beyond)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    system_prompt: str | None = None
    """System message before the task instruction."""
    kind: Literal["mcp", "openai_gateway"] = "mcp"
    """`mcp`: our MCP agent samples token ids itself; `openai_gateway`: the Harbor agent at
    `import_path` speaks `/chat/completions` to a per-trial TITO gateway session."""
    import_path: str | None = None
    """Harbor agent class (`module:Class`); None = oneloop's MCP agent (kind `mcp`) or its
    LiteLLM tool agent (kind `openai_gateway`)."""


class RolloutConfig(_Strict):
    max_concurrency: int = Field(default=16, ge=1)
    """System cap on trials running at once (trials); the loop also caps at (S+1)·B·n."""
    trials_per_second: float = Field(default=50.0, gt=0)
    """Rate limit on trial starts (trials/s)."""
    trial_timeout_s: float = Field(default=600.0, gt=0)
    """Limit on one whole trial (seconds)."""
    max_infra_retries: int = Field(default=2, ge=0)
    """Fresh trials after an infrastructure error, per trajectory (count)."""
    environment_import_path: str = "oneloop.agents.environment:NoContainerEnvironment"
    """Harbor environment class (`module:Class`); the default is for the demo and tests only."""
    environment_type: str | None = None
    """Harbor environment type (`docker`, `modal`, `daytona`, ...); replaces the import path."""
    environment_kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment class (Harbor `environment.kwargs`)."""
    verifier_import_path: str | None = None
    """Harbor verifier class (`module:Class`, e.g. `oneloop.agents.judge:LlmJudgeVerifier`); None =
    the task's own tests/test.sh."""
    verifier_kwargs: dict[str, Any] = {}
    """Keyword arguments of the verifier class (Harbor `verifier.kwargs`)."""

    @model_validator(mode="after")
    def _one_environment(self) -> "RolloutConfig":
        if self.environment_type is not None and "environment_import_path" in self.model_fields_set:
            raise ValueError(
                "set environment_type or environment_import_path, not both "
                f"(got {self.environment_type!r} and {self.environment_import_path!r})"
            )
        return self


class AlgoConfig(_Strict):
    max_steps: int = Field(default=20, ge=1)
    """Optimizer steps of RL (count)."""
    max_staleness: int = Field(default=3, ge=0)
    """S: most steps a group's sampler version may lag the step it is trained at (0 = on-policy)."""
    groups_per_step: int = Field(default=4, ge=1)
    """B: prompt groups per optimizer step (count)."""
    group_size: int = Field(default=4, ge=1)
    """n: samples per prompt (count)."""
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro"] = "importance_sampling"
    """Tinker built-in RL loss."""
    loss_fn_config: dict[str, float] = {}
    """Loss parameters (clip thresholds for ppo/cispo, beta for dro)."""
    reduction: Literal["token_sum", "token_mean", "prompt_mean"] = "prompt_mean"
    """How per-token losses are combined, by scaling advantages (both backends compute the same)."""
    std_normalize: bool = False
    """Divide group advantages by the group's reward std."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no signal); counted."""
    max_zero_variance_in_a_row: int | None = Field(default=64, ge=1)
    """Stop the run, with the counts and the advice to run `oneloop eval` first, when this many
    groups in a row are dropped for zero reward variance with none accepted between them (a
    policy that solves all or none of its tasks trains nothing); null = never (count)."""
    learning_rate: float = Field(default=1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip (0 = off)."""
    sampler_kind: Literal["auto", "inflight", "snapshot"] = "auto"
    """Sampling client kind; auto = inflight where the backend supports it."""
    routing_replay: bool = False
    """Rollout routing replay (R3), MoE models only: the trainer computes each sampled token with
    the experts the sampler routed it to (local backend, torch engines; refused elsewhere)."""
    seed: int = 0
    """Seed of data order and sampling seeds."""


class SftConfig(_Strict):
    data: Literal["demo"] | Path
    """Chat-conversation JSONL with tool calls, one per line (see `oneloop.loop.sft`); "demo" = the
    demonstrations written beside the generated demo tasks (tasks.dir null)."""
    steps: int = Field(default=40, ge=1)
    """Supervised warm-start steps (count)."""
    batch_size: int = Field(default=16, ge=1)
    """Conversations per step (count)."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """AdamW learning rate of the warm start (the peak, with a schedule)."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """"linear" decays the rate from `learning_rate` to 0 over `steps`, so the warm start ends in
    a settled state rather than on a full-size step."""


class EvalConfig(_Strict):
    n_tasks: int | None = Field(default=None, ge=1)
    """Held-out tasks to evaluate (None = all)."""
    samples_per_task: int = Field(default=1, ge=1)
    """Samples per held-out task (count)."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of evaluation (0 = greedy)."""
    agent: str = "mcp"
    """Harbor agent of `oneloop eval` (mcp, oracle, a Harbor agent name, module:Class); the
    training loop's held-out evaluation runs its own model, so it accepts mcp only."""


class CheckpointConfig(_Strict):
    every_steps: int = Field(default=5, ge=1)
    """Save trainer state + loop state every K steps."""


class TimeoutsConfig(_Strict):
    group_s: float = Field(default=900.0, gt=0)
    """Limit on one rollout group; a stuck group is cancelled and its task re-queued (seconds)."""
    wait_for_rollouts_s: float = Field(default=1800.0, gt=0)
    """Limit on waiting for a step's groups (seconds)."""
    train_s: float = Field(default=1800.0, gt=0)
    """Limit on forward_backward + optim_step (seconds)."""
    sync_s: float = Field(default=600.0, gt=0)
    """Limit on publishing weights to the samplers (seconds)."""


class LoggingConfig(_Strict):
    console: bool = True
    """Print one progress line per step (and the wait lines below; off: they go to the log)."""
    wait_progress_s: float = Field(default=30.0, gt=0)
    """While a step waits for its rollout groups, report progress this often: groups finished,
    dropped for zero variance, masked, in flight, time waited (seconds)."""
    wandb: dict[str, Any] | None = None
    """Weights & Biases init kwargs (project, name, ...); None = off."""
    tensorboard: bool = False
    """Write TensorBoard event files under run_dir/tb."""
    trajectories_per_step: int = Field(default=4, ge=0)
    """Decoded trajectories (with masks) written per step to trajectories.jsonl (count)."""


class TrainConfig(_Strict):
    run_dir: Path = Path("runs/train")
    """Where metrics, plots, trajectories, checkpoints and Harbor trials go."""
    backend: BackendConfig = BackendConfig()
    """Which backend runs the model (`--backend local|tinker`)."""
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    agent: AgentConfig = AgentConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    sft: SftConfig | None = None
    """Supervised warm start before RL; None = off."""
    eval: EvalConfig | None = None
    """Held-out evaluation before and after RL; None = off."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.sft is not None and self.sft.data == "demo" and self.tasks.dir is not None:
            raise ValueError(
                "sft.data: 'demo' is the generated demo tasks' demonstrations, but tasks.dir is "
                "set; give the path of a chat-conversation JSONL"
            )
        return self

    def check_model(self) -> None:
        """Routing replay, expert parallelism and the megatron engine's layout against the backend
        and the model's config (`load_config` runs it, before any engine starts); CapabilityError
        naming the field."""
        from oneloop.backends import model_check
        from oneloop.backends.capabilities import TINKER_SERVICE, local_capabilities

        local = self.backend.local
        replay = self.algo.routing_replay
        if replay:
            caps = (
                local_capabilities(
                    1, (), local.trainer_engine, local.sampler_engine,
                    vllm_routed_experts=local.vllm.return_routed_experts,
                )  # fmt: skip
                if self.backend.backend == "local"
                else TINKER_SERVICE
            )
            model_check.check_routing_replay_backend(
                caps.routing_replay, self.backend.backend, "algo.routing_replay"
            )
        ep = local.megatron.ep if self.backend.backend == "local" else 1
        megatron = self.backend.backend == "local" and local.trainer_engine == "megatron"
        if replay or ep > 1 or megatron:
            config = model_check.model_config(self.backend.models, self.model.base_model)
            if config is not None:
                model_check.check_model(
                    config, base_model=self.model.base_model, ep=ep, routing_replay=replay
                )
            if config is not None and megatron:
                model_check.check_megatron_layout(
                    config, megatron=local.megatron, gpus_per_trainer=local.gpus_per_trainer,
                    lora_rank=self.model.lora_rank,
                )  # fmt: skip


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `tree[a][b][c] = value` for `a.b.c`, creating mappings on the way."""
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def presets() -> Traversable:
    """The shipped presets' folder, wherever the package is installed (source tree or wheel)."""
    return resources.files(PRESETS_PACKAGE) / "presets"


def preset_names() -> list[str]:
    """Names of the shipped presets (`demo-cpu`, ...), sorted."""
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in presets().iterdir()
        if entry.name.endswith(".yaml") and entry.is_file()
    )


def resolve_config_path(name: str | Path) -> Path | Traversable:
    """A YAML path, or the name of a shipped preset (with or without .yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml")
    if stem in preset_names():
        return presets() / f"{stem}.yaml"
    raise ConfigError(f"config: {name!s} is neither a file nor a preset; presets: {preset_names()}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read, override, validate. Errors are ConfigError naming dotted paths."""
    raw: dict = {}
    if path is not None:
        source = resolve_config_path(path)
        loaded = yaml.safe_load(source.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {source}: the top level must be a mapping")
        raw = loaded or {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        set_dotted(raw, key.strip(), yaml.safe_load(text))
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
    config.check_model()
    return config
