"""Ray's worker setup hook for a real `oneloop train` run whose megatron trainer ranks run on CPU
(test_megatron_run_kill_resume.py).

The product runs the megatron engine on CUDA only: `engines.factory` builds it with
device="cuda" (`local.device` is the torch engines' setting), and megatron-core on a CPU needs the
test-only CUDA-on-CPU shims of `cpu_megatron`, which product code never installs. So the run
under test gets this module as its Ray job's `worker_process_setup_hook`, given through
`RAY_JOB_CONFIG_JSON_ENV_VAR`, which is how Ray's job submitter passes a runtime env to a driver
it did not write. The product's `ray.init` passes no runtime env of its own, so it takes this one.
Every worker of the run then runs `install` before it loads any actor class or task.

`install` changes one thing: the `MegatronRayGroup` that the factory builds puts its ranks on the
CPU (device cpu, no GPU a rank), and each rank actor installs the shims first (`setup`, the hook
the gloo checks use). Everything else is the product's own code: config validation, the factory's
checks and settings, the group, its rank actors, the trainer actor and the loop. Importing the
group (megatron-core, about 9 s on 2 cores) waits until a worker builds a megatron trainer, so
the sampler and trial workers do not pay for it.
"""

import functools
from typing import Any

HOOK = "megatron_run_hook.install"
"""`worker_process_setup_hook` value (this folder must be on the workers' PYTHONPATH)."""


def install() -> None:
    """Runs first in every Ray worker of the run: the factory's megatron groups on CPU."""
    from oneloop.backends.megatron_local.engines import factory

    make = factory.make_trainer_engine
    if getattr(make, "ranks_on_cpu", False):
        return

    @functools.wraps(make)
    def make_on_cpu(local, model_path, lora):
        if local.trainer_engine == "megatron":
            _groups_on_cpu()
        return make(local, model_path, lora)

    make_on_cpu.ranks_on_cpu = True  # type: ignore[attr-defined]
    factory.make_trainer_engine = make_on_cpu


def _groups_on_cpu() -> None:
    from oneloop.backends.megatron_local.engines.megatron import group

    build = group.MegatronRayGroup
    if not isinstance(build, type):  # already wrapped in this process
        return

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(device="cpu", gpus_per_rank=0, setup=rank_setup)
        return build(*args, **kwargs)

    group.MegatronRayGroup = on_cpu  # the factory imports the name when it builds a group


def rank_setup() -> None:
    """Runs first in every rank actor (`MegatronRayGroup(setup=...)`): megatron-core on CPU."""
    import cpu_megatron

    cpu_megatron.cuda_calls_on_cpu(allocations=True)
