"""Whether a megatron engine checkpoint's optimizer state can resume on this trainer."""

from pathlib import Path
from typing import Any


def check_resumable(
    directory: Path, state: dict[str, Any], layout: dict[str, int], layer_spec: str
) -> None:
    """Raise ValueError, naming both, unless `state` (the checkpoint's engine.json) was saved at
    this trainer's parallel `layout` (tp, pp, cp, dp, ep) and on its `layer_spec`: optimizer
    state is one file per rank of the saved layout, over the saved spec's modules. Checked before
    anything loads."""
    saved = {k: int(state.get(k, 1)) for k in layout}
    if saved != layout:
        shown = [k for k in layout if k not in ("dp", "ep") or saved[k] != 1 or layout[k] != 1]
        sizes = [" ".join(f"{k}={x[k]}" for k in shown) for x in (saved, layout)]
        raise ValueError(
            f"{directory}: optimizer state was saved at local.megatron {sizes[0]}, this "
            f"trainer runs {sizes[1]}; resume at the saved sizes or load the weights only"
        )
    saved_spec = state.get("layer_spec", "local")  # written before TE was built: local
    if saved_spec != layer_spec:
        raise ValueError(
            f"{directory}: optimizer state was saved on the {saved_spec!r} layer spec, this "
            f"trainer builds {layer_spec!r} (local.megatron.speed.layer_spec): their "
            "parameters are different modules; set layer_spec to the saved one to resume, or "
            "load the weights only"
        )
