"""Per-function wall time inside vLLM's processes, for the R3 (routed experts) cost study.

Put this folder first on PYTHONPATH with R3PROF_DIR set: every Python process started under it
(the bench's front end and vLLM's spawned engine core alike) wraps a few vLLM methods when their
modules are imported and writes {phase: {"Class.method": [calls, seconds]}} to
$R3PROF_DIR/<pid>.json every 2 s and at exit. The phase is read from $R3PROF_PHASE at each call
(the engine core inherits it when spawned); an engine core spawned with $R3PROF_SKIP_CLEAR=1
skips the routing capture buffer's per-step zeroing. Wrapping costs about a microsecond a call,
the same with R3 on and off. Any other sitecustomize on the path runs first (this one only adds
hooks).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    _cand = os.path.join(os.path.abspath(_p or "."), "sitecustomize.py")
    if os.path.abspath(_p or ".") != _HERE and os.path.isfile(_cand):
        with open(_cand) as _f:
            exec(compile(_f.read(), _cand, "exec"), {"__name__": "_site_orig", "__file__": _cand})
        break

if os.environ.get("R3PROF_DIR"):
    import atexit
    import importlib.abc
    import json
    import threading
    import time

    # module -> {class: [methods]}: the engine core's step and its parts, the wire, the front end
    TARGETS = {
        "vllm.v1.engine.core": {"EngineCore": ["step", "step_with_batch_queue"]},
        "vllm.v1.core.sched.scheduler": {
            "Scheduler": ["schedule", "update_from_output", "_update_after_schedule"]
        },
        "vllm.v1.core.sched.async_scheduler": {"AsyncScheduler": ["_update_after_schedule"]},
        "vllm.v1.worker.gpu_model_runner": {
            "GPUModelRunner": ["execute_model", "sample_tokens", "_bookkeeping_sync"],
            "AsyncGPUModelRunnerOutput": ["__init__", "get_output"],
        },
        "vllm.v1.serial_utils": {
            "MsgpackEncoder": ["encode", "encode_into"],
            "MsgpackDecoder": ["decode"],
        },
        "vllm.v1.engine.output_processor": {"OutputProcessor": ["process_outputs"]},
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer": {
            "RoutedExpertsCapturer": ["capture", "clear_buffer"],
            "RoutedExpertsManager": ["store_batch", "get"],
        },
    }
    STATS: dict = {}
    _lock = threading.Lock()

    def _wrap(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                phase = os.environ.get("R3PROF_PHASE", "-")
                with _lock:
                    entry = STATS.setdefault(phase, {}).setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += dt

        timed.__wrapped__ = fn
        timed.__name__ = fn.__name__
        timed.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
        return timed

    def _patch(module):
        capturer = getattr(module, "RoutedExpertsCapturer", None)
        if capturer is not None and os.environ.get("R3PROF_SKIP_CLEAR") == "1":
            # gpu_vllm.py --skip-clear-side: what vLLM's per-step zeroing of the capture buffer
            # costs. Skipping it is safe for the rows a step reads: every MoE layer writes all
            # of the step's rows, and a column no layer writes stays zero from its allocation.
            capturer.clear_buffer = lambda self: None
        for cls_name, methods in TARGETS[module.__name__].items():
            cls = getattr(module, cls_name, None)
            for m in methods if cls is not None else ():
                if m in cls.__dict__:
                    setattr(cls, m, _wrap(f"{cls_name}.{m}", cls.__dict__[m]))

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader, run = spec.loader, spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())

    def _dump():
        out = os.path.join(os.environ["R3PROF_DIR"], f"{os.getpid()}.json")
        with _lock:
            text = json.dumps(STATS)
        if STATS:
            with open(out + ".tmp", "w") as f:
                f.write(text)
            os.replace(out + ".tmp", out)

    def _loop():
        while True:
            time.sleep(2.0)
            try:
                _dump()
            except OSError:
                pass

    os.makedirs(os.environ["R3PROF_DIR"], exist_ok=True)
    threading.Thread(target=_loop, name="r3prof-dump", daemon=True).start()
    atexit.register(_dump)
