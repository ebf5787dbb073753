"""What the Megatron engine checks on gloo ranks share (tests/backends/engines/megatron_cpu/).

Owns the CUDA-on-CPU stand-ins those checks install (never product code), the tiny random Qwen3
they build, random data, the engine they drive (one process, or `megatron.group` ranks on gloo),
the subprocess per phase (one torch.distributed world per process) and the comparison helpers.
Each check is a pair: `<name>_gloo_phases.py`, the script a phase runs in its own process (its own
calls; it installs the shims), and `test_megatron_<name>_gloo.py`, the pytest test that runs the
phases and asserts the figures and tolerances on what they wrote.

The shims must reach every rank: `megatron.group` runs each rank in a Ray actor, which imports the
phase script as a module before building its engine (`phase_setup`), so a phase script installs
its shims and patches at its top level. oneloop
is imported inside the functions here, so a script can install the shims before anything imports
megatron-core. Importing this module installs nothing: the pytest process imports it for the
comparison helpers and `run_phases`, and never calls `cuda_calls_on_cpu`.
"""

import contextlib
import functools
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

# torch factories that megatron-core's DDP, optimizer, schedules and grad-norm code call with
# `device="cuda"` (or a CUDA device index) for small scalars and buffers.
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange")
GROUP_TIMEOUT_S = 300  # per group call: a tiny model on 2 shared cores, ranks on gloo
PHASE_TAIL_LINES = 80  # lines of a failed phase's output its error carries


class NullStream:
    """A CUDA stream or event that is never waited on: everything runs in order on the CPU."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def wait_event(self, *_args) -> None:
        pass

    def wait_stream(self, *_args) -> None:
        pass

    def record_event(self, *_args) -> "NullStream":
        return NullStream()

    def synchronize(self) -> None:
        pass

    def wait(self, *_args) -> None:
        pass


def _cpu(device):
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def inner(*args, **kwargs):
        if kwargs.get("device") is not None:
            kwargs["device"] = _cpu(kwargs["device"])
        return factory(*args, **kwargs)

    return inner


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):  # Megatron's optimizers accept torch.cuda.* only
    out = _tensor_type(self, *args, **kwargs)
    if not args and not kwargs and out.startswith("torch.") and not out.startswith("torch.cuda."):
        return out.replace("torch.", "torch.cuda.", 1)
    return out


_installed: set[str] = set()


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's RoPE chunk selection for a CP rank (chunks r and 2cp-1-r) on the tables' own
    device: megatron-core builds the index with `pin_memory=True` and `.cuda()`."""
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def cuda_calls_on_cpu(*, device: str | int = "cpu", allocations: bool = False) -> None:
    """Make the CUDA calls megatron-core makes on a CPU run no-ops (idempotent).

    `torch.cuda.current_device()` returns `device` ("cpu": RoPE moves its frequencies there and
    the p2p shape buffers are allocated there; an index for a check that maps it itself);
    streams and events are `NullStream`s, `torch.cuda.stream(...)` a null context,
    `synchronize` returns at once, and a CP rank's RoPE chunks are selected on the CPU
    (`_pos_emb_on_this_cp_rank`). With `allocations`, also: the `FACTORIES` put tensors asked
    for on CUDA on the CPU, `Tensor.cuda()` returns the tensor itself, and `Tensor.type()` names
    a CPU tensor `torch.cuda.*Tensor` (Megatron's DDP, optimizer and schedules on CPU tensors),
    megatron-core's CUDA RNG tracker forks to a null context (sequence parallelism's dropouts),
    and activation recompute's CUDA RNG state is empty.
    """
    torch.cuda.current_device = lambda: device
    torch.cuda.current_stream = lambda *_args, **_kwargs: NullStream()
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    torch.cuda.Stream, torch.cuda.Event = NullStream, NullStream
    torch.cuda.stream = lambda *_args, **_kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *_args, **_kwargs: None
    if allocations and "allocations" not in _installed:
        _installed.add("allocations")
        for name in FACTORIES:
            setattr(torch, name, _on_cpu(getattr(torch, name)))
        torch.Tensor.cuda = lambda self, *_args, **_kwargs: self
        torch.Tensor.type = _cuda_type_name
        # Sequence parallelism forks megatron-core's CUDA RNG tracker around its dropouts (the
        # engine seeds it on CUDA only; every dropout is 0 here): forking changes nothing on CPU
        from megatron.core.tensor_parallel import random as megatron_random

        tracker = megatron_random.CudaRNGStatesTracker
        tracker.fork = lambda *_args, **_kwargs: contextlib.nullcontext()
        # activation recompute saves and restores the CUDA RNG state around each checkpoint:
        # there is none on CPU (the CPU generator's state is still saved and restored)
        megatron_random._get_cuda_rng_state = lambda *_args, **_kwargs: torch.empty(0)
        megatron_random._set_cuda_rng_state = lambda *_args, **_kwargs: None


def gloo_all_to_all() -> None:
    """Let megatron-core's MoE token dispatcher run on gloo (idempotent): it hands
    `all_to_all_single` its split sizes as CPU tensors, gloo's binding takes lists."""
    if "all_to_all" in _installed:
        return
    _installed.add("all_to_all")
    all_to_all = torch.distributed.all_to_all_single

    def gloo_all_to_all_single(output, input_, output_split_sizes=None, input_split_sizes=None,
                               **kwargs):  # fmt: skip
        sizes = [s.tolist() if isinstance(s, torch.Tensor) else s
                 for s in (output_split_sizes, input_split_sizes)]  # fmt: skip
        return all_to_all(output, input_, *sizes, **kwargs)

    torch.distributed.all_to_all_single = gloo_all_to_all_single


def gdn_without_fla() -> None:
    """Let megatron-core's Gated DeltaNet run on CPU (idempotent). With `deterministic_mode` (the
    engine sets it on CPU) it uses its torch chunked delta rule and `F.conv1d`, but it still
    refuses to build without flash-linear-attention (`HAVE_FLA`) and calls fla's Triton `l2norm`
    on q and k; this stands in the same formula as fla and transformers (x · rsqrt(Σx² + 1e-6))."""
    if "gdn" in _installed:
        return
    _installed.add("gdn")
    from megatron.core.ssm.gated_delta_net import common

    def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    common.HAVE_FLA = True
    common.l2norm = l2norm


def tiny_qwen3(directory: Path, *, layers: int = 2, tied: bool = True) -> Path:
    """A random Qwen3 (GQA, QK-norm; seed 0) saved in HF form in `directory`, once."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if not (directory / "config.json").is_file():
        config = Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=tied,
            max_position_embeddings=256,
        )
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def build_model(directory: Path, **kwargs) -> Path:
    """`tiny_qwen3` from the pytest process, before phases that run concurrently (each would
    otherwise write the same files at once); torch's global RNG is left as it was."""
    with torch.random.fork_rng():
        return tiny_qwen3(directory, **kwargs)


def random_data(
    rng: np.random.Generator,
    lengths: Iterable[int],
    inputs: Callable[[np.random.Generator, int], dict[str, np.ndarray]],
) -> list:
    """One datum per length: random tokens (vocab 128) shifted by one into the targets, then the
    loss inputs `inputs(rng, n)` (drawn after the tokens, from the same `rng`)."""
    from oneloop.backends.megatron_local.engines.base import DatumArrays

    data = []
    for n in lengths:
        tokens = rng.integers(0, 128, n + 1)
        data.append(DatumArrays(tokens[:-1], tokens[1:], inputs(rng, n)))
    return data


def ones(_rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Loss inputs of plain cross_entropy: every token weighs 1."""
    return {"weights": np.ones(n, np.float32)}


def import_phase(name: str) -> None:
    """Run in every rank actor before its engine is built: import phase script `name` (a module
    of this folder) so its top level installs the same shims and patches as the phase process."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    importlib.import_module(name)


def start_ray(cpus: int) -> None:
    """A local Ray runtime for a phase's group (once per process): `cpus` logical CPUs, and this
    folder on every worker's path (the rank actors import the phase script, `import_phase`)."""
    import os

    import ray

    if ray.is_initialized():
        return
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",  # a new runtime here, never another process's cluster
        num_cpus=cpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )


def phase_setup() -> Callable[[], None]:
    """`MegatronRayGroup(setup=...)` for the running phase script (this process's __main__)."""
    return functools.partial(import_phase, Path(sys.modules["__main__"].__file__).stem)


def check_speed(**switches: Any) -> Any:
    """The engine's speed switches for a check (`switches` override): the defaults but for the
    two that compile with Inductor (`swiglu_fusion`, `compile_logprobs`). On CPU that compile
    costs ~30 s per process and rank on CI's two cores, for kernels the checks do not compare:
    test_fused_logprobs checks the compiled logprob kernels against eager, and the TP check
    (tp_gloo_phases.py) runs the engine's full defaults on gloo ranks."""
    from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed

    return MegatronSpeed(**{"swiglu_fusion": False, "compile_logprobs": False, **switches})


def make_engine(model: Path, spec, *, group: bool, **kwargs) -> tuple[Any, Callable[..., Any]]:
    """The one-process engine, or (`group`) `megatron.group`'s Ray actors with ranks on gloo (a
    local Ray runtime started here); and `call`, which runs an engine method by name on every
    rank (`call("_dump_grads", path)`). Speed switches: `check_speed()` unless given."""
    kwargs.setdefault("speed", check_speed())
    if not group:
        from oneloop.backends.megatron_local.engines.megatron.trainer import (
            MegatronTrainerEngine,
        )

        engine = MegatronTrainerEngine(model, spec, **kwargs)

        def call(method: str, *args):
            return getattr(engine, method)(*args)

        return engine, call
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup

    parallel = kwargs["parallel"]
    start_ray(parallel.tp * parallel.pp * parallel.cp * parallel.dp)
    kwargs.setdefault("threads", 1)
    engine = MegatronRayGroup(
        model, spec, timeout_s=GROUP_TIMEOUT_S, setup=phase_setup(), gpus_per_rank=0, **kwargs
    )
    return engine, engine.call


def all_gather_parts(grad: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every TP rank's shard of `grad`, in rank order (a collective)."""
    parts = [torch.empty_like(grad) for _ in range(size)]
    torch.distributed.all_gather(parts, grad.contiguous(), group=group)
    return parts


HERE = Path(__file__).resolve().parent


def megatron_core_installed() -> bool:
    """Whether megatron-core imports here (the `megatron-cpu` dependency group that `uv sync`
    installs by default; checked without importing it into the pytest process)."""
    return importlib.util.find_spec("megatron") is not None and (
        importlib.util.find_spec("megatron.core") is not None
    )


class PhaseFailed(AssertionError):
    """A phase process exited non-zero. The message carries its command, its exit code and the
    end of its output (from its last traceback on, Ray's and Python's warnings left out), so CI's
    report shows why rather than only that; the whole output stays in the phase's log file."""

    def __init__(self, cmd: Sequence[str], code: int, log: Path) -> None:
        lines = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if "Warning" not in line and "warnings.warn" not in line
        ]
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        tail = lines[starts[-1] :] if starts else lines[-PHASE_TAIL_LINES:]
        super().__init__(
            f"phase {' '.join(cmd[1:])} exited with {code}; its output is in {log}; "
            f"it ended with:\n" + "\n".join(tail[-PHASE_TAIL_LINES:])
        )


@contextlib.contextmanager
def _phase_log(work: Path, phase: Sequence[str]):
    """The file a phase's stdout and stderr go to, named after its arguments, and its path."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / ("phase" + "".join(f"_{a.strip('-')}" for a in phase) + ".log")
    with path.open("w") as log:
        yield log, path


def run_phases(
    script: str, work: Path, phases: Iterable[Sequence[str]], *, timeout: int = 900
) -> None:
    """Run `script` (a name in this folder, or a path) once per phase (its extra arguments) with
    `--work work`, each in its own process: one torch.distributed world per process, and the CUDA
    shims never reach the caller's. A failing phase raises `PhaseFailed`."""
    for phase in phases:
        cmd = [sys.executable, str(HERE / script), *phase, "--work", str(work)]
        with _phase_log(work, phase) as (log, path):
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if code.returncode != 0:
            raise PhaseFailed(cmd, code.returncode, path)


def run_phases_concurrently(
    script: str, work: Path, phases: Iterable[Sequence[str]], *, timeout: int = 900
) -> None:
    """`run_phases` for phases that do not read each other's output: all at once, each in its own
    process. Most of a phase's time is its imports, one core each: on CI's two cores, a
    one-process phase beside another phase uses the core it would leave idle. A failing phase
    raises `PhaseFailed` (after the others are stopped)."""
    phases = list(phases)
    cmds = [[sys.executable, str(HERE / script), *p, "--work", str(work)] for p in phases]
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(_phase_log(work, p)) for p in phases]
        procs = [
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            for cmd, (log, _) in zip(cmds, logs, strict=True)
        ]
    try:
        for proc, cmd, (_, path) in zip(procs, cmds, logs, strict=True):
            if proc.wait(timeout=timeout) != 0:
                raise PhaseFailed(cmd, proc.returncode, path)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def train_steps(
    engine,
    steps: Iterable[int],
    out: dict,
    tag: str,
    *,
    data: Callable[[int], list],
    adams: Sequence[dict],
    weights: Callable[[Any], dict],
    save: Path | None = None,
) -> None:
    """forward_backward (cross_entropy on `data(step)`) + optim_step (`adams[step]`) per step;
    loss, logprobs, grad norm and `weights(engine)` under `{tag}/...` in `out` (what `run_gaps`
    compares); `save`: a checkpoint with the optimizer after step 0."""
    for step in steps:
        result = engine.forward_backward(data(step), "cross_entropy", None, False)
        stats = engine.optim_step(adams[step])
        out[f"{tag}/loss{step}"] = result.loss
        out[f"{tag}/lp{step}"] = np.concatenate(result.logprobs)
        out[f"{tag}/grad_norm{step}"] = stats["grad_norm:mean"]
        out[f"{tag}/weights{step}"] = weights(engine)
        if save is not None and step == 0:
            engine.save_state(save, with_optimizer=True)


def microbatch_counts(steps: Sequence[Sequence[int]], dp: int, budget: int) -> list[list[int]]:
    """Per step (its datums' lengths), each data-parallel replica's micro-batch count under the
    token `budget` (what the megatron engine's idle EP micro-batches even out)."""
    from oneloop.backends.megatron_local.engines.megatron.data_parallel import dp_shares
    from oneloop.backends.megatron_local.engines.microbatch import pack_microbatches

    return [
        [len(pack_microbatches([lengths[i] for i in share], budget)) for share in
         dp_shares(list(lengths), dp)]
        for lengths in steps
    ]  # fmt: skip


R3_METRICS = ("positions", "differ", "gap_tokens", "gap_replay", "gap_free")


def r3_data(lengths: Sequence[int], layers: int, experts: int, k: int) -> list:
    """Datums of `lengths` with importance_sampling inputs (sampler logprobs, advantages) and a
    routing record (distinct random experts per position and layer), some datums recording
    fewer positions than they feed (the rest route freely)."""
    import dataclasses

    rng = np.random.default_rng(7)

    def inputs(r: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        return {"logprobs": -r.uniform(0.5, 4.0, n).astype(np.float32),
                "advantages": r.normal(0.0, 1.0, n).astype(np.float32)}  # fmt: skip

    data = []
    for i, datum in enumerate(no_pad_tokens(random_data(rng, lengths, inputs))):
        n = len(datum.tokens) - i % 3
        routing = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :k].astype(np.int16)
        data.append(dataclasses.replace(datum, routing=routing))
    return data


def count_layer_calls(engine) -> list[int]:
    """A one-element list that counts the forwards of the engine's first decoder layer from now
    on (activation recompute runs it again in the backward)."""
    calls = [0]

    def hook(*_args) -> None:
        calls[0] += 1

    engine.module.decoder.layers[0].register_forward_pre_hook(hook)
    return calls


def replay_call(
    engine, model: Path, out: dict, tag: str, lengths: Sequence[int], adam: dict, *,
    backward: bool,
) -> None:  # fmt: skip
    """One importance_sampling call on `r3_data(lengths, ...)` with routing replay: logprobs,
    loss and the routing metrics under `{tag}/r3_...`; with `backward`, the grad norm (an lr-0
    step, so the engine's weights stay as they were)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    layers, experts, k = config.num_hidden_layers, config.num_experts, config.num_experts_per_tok
    result = engine.forward_backward(
        r3_data(lengths, layers, experts, k), "importance_sampling", None, not backward
    )
    out[f"{tag}/r3_lp"] = np.concatenate(result.logprobs)
    out[f"{tag}/r3_loss"] = result.loss
    for name in R3_METRICS:
        out[f"{tag}/r3_{name}"] = result.metrics[f"routing/{name}:sum"]
    if backward:
        lr0 = dict(adam, learning_rate=0.0, weight_decay=0.0)
        out[f"{tag}/r3_grad_norm"] = engine.optim_step(lr0)["grad_norm:mean"]


def r3_gaps(out: dict, tags: tuple[str, ...]) -> dict:
    """Each tag's replayed call against the torch engine's."""
    figures = {}
    for tag in tags:
        gap = np.abs(out[f"{tag}/r3_lp"] - out["torch/r3_lp"]).max()
        figures[f"{tag}_r3_logprob_gap"] = float(gap)
        figures[f"{tag}_r3_loss_rel_gap"] = abs(out[f"{tag}/r3_loss"] / out["torch/r3_loss"] - 1)
        for name in R3_METRICS:
            figures[f"{tag}_r3_{name}"] = [out[f"{tag}/r3_{name}"], out[f"torch/r3_{name}"]]
        if f"{tag}/r3_grad_norm" in out:
            ratio = out[f"{tag}/r3_grad_norm"] / out["torch/r3_grad_norm"]
            figures[f"{tag}_r3_grad_norm_rel_gap"] = abs(ratio - 1)
    return figures


def no_pad_tokens(data: list) -> list:
    """`data` with token 0, the tiny models' pad_token_id, replaced by 1 (in place): transformers'
    embedding freezes that row (`padding_idx`, no gradient), megatron's trains it like any other."""
    for datum in data:
        datum.tokens[datum.tokens == 0] = 1
        datum.targets[datum.targets == 0] = 1
    return data


def train_pad_free(
    engine, out: dict, tag: str, lengths: Sequence[Sequence[int]], adams: Sequence[dict],
    save: Path | None = None,
) -> None:  # fmt: skip
    """`train_steps` over one step per `lengths` entry: cross_entropy on random datums of those
    lengths (seed = step, `no_pad_tokens`), weights in transformers' layout (`fused_weights`)."""

    def data(step: int) -> list:
        return no_pad_tokens(random_data(np.random.default_rng(step), lengths[step], ones))

    steps = range(len(lengths))
    train_steps(engine, steps, out, tag, data=data, adams=adams, weights=fused_weights, save=save)


def fused_weights(engine) -> dict[str, np.ndarray]:
    """An engine's sampler weights in transformers' module layout, fp32 copies (the megatron
    engine exports checkpoint names, experts per expert; the torch engine its fused experts)."""
    from oneloop.backends.megatron_local.engines.hf import fuse_experts

    weights = fuse_experts(engine.sampler_weights())
    return {k: np.asarray(v, np.float32).copy() for k, v in weights.items()}


def phase_main(doc: str, phases: Mapping[str, Callable[[Path], None]]) -> int:
    """The command line of a two-phase script: `--phase NAME --work DIR` runs `phases[NAME]`."""
    import argparse

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--phase", choices=tuple(phases), required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the figures go")
    args = parser.parse_args()
    phases[args.phase](args.work)
    return 0


def save_run(path: Path, out: Mapping[str, Any]) -> None:
    """A phase's `train_steps` figures to an .npz (`{tag}/weights{step}` dicts flattened), for a
    later phase in another process (`load_run`)."""
    flat = {k: v for k, v in out.items() if not isinstance(v, dict)}
    for key, weights in out.items():
        if isinstance(weights, dict):
            flat.update({f"{key}/{name}": w for name, w in weights.items()})
    np.savez(path, **flat)


def load_run(path: Path) -> dict:
    """Inverse of `save_run` (scalars back as floats)."""
    out: dict = {}
    with np.load(path) as saved:
        for key in saved.files:
            head, _, name = key.partition("/weights")
            if name:  # torch/weights0/model.x.weight
                step, _, weight = name.partition("/")
                out.setdefault(f"{head}/weights{step}", {})[weight] = saved[key]
            else:
                out[key] = saved[key] if saved[key].ndim else float(saved[key])
    return out


def weights_gap(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """max |a - b| over every weight (both hold the same names)."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:6]
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def run_gaps(out: Mapping[str, Any], tags: Iterable[str], steps: int, ref: str = "ref") -> dict:
    """Each run `tag` against run `ref`, per step (the `_train` figures of a phase script:
    `{tag}/loss{step}`, `grad_norm`, `lp`, `weights`): loss and grad-norm relative gaps, logprob
    and weight max abs gaps."""
    figures: dict = {}
    for tag in tags:
        for step in range(steps):
            mine, base = f"{tag}/", f"{ref}/"
            for name in ("loss", "grad_norm"):
                key = f"{name}{step}"
                figures[f"{tag}_{key}_rel_gap"] = abs(out[mine + key] / out[base + key] - 1)
            lp = f"lp{step}"
            gap = np.abs(out[mine + lp] - out[base + lp]).max()
            figures[f"{tag}_logprob{step}_gap"] = float(gap)
            w = f"weights{step}"
            figures[f"{tag}_weights{step}_gap"] = weights_gap(out[mine + w], out[base + w])
    return figures


def max_abs_diff(a: Mapping[str, Any], b: Mapping[str, Any], keys: Iterable[str]) -> float:
    """max |a[k] - b[k]| over every element of every key."""
    return max(float(np.abs(a[k] - b[k]).max()) for k in keys)


def prefix_abs_diff_max(a: np.lib.npyio.NpzFile, b: np.lib.npyio.NpzFile, prefix: str) -> float:
    """`max_abs_diff` over the arrays whose names start with `prefix` (both hold the same ones)."""
    keys = [k for k in a.files if k.startswith(prefix)]
    assert keys and sorted(keys) == sorted(k for k in b.files if k.startswith(prefix)), prefix
    return max_abs_diff(a, b, keys)


def grad_rel_diff_max(g1: np.lib.npyio.NpzFile, gn: np.lib.npyio.NpzFile) -> float:
    """max over gradients of max |g1 - gn| / max |g1| (a gradient's scale sets its tolerance)."""
    return max(float(np.abs(g1[k] - gn[k]).max() / (np.abs(g1[k]).max() + 1e-12)) for k in g1.files)
