"""Imports GPU-runbook modules (tests/gpu and benchmarks/gpu_* files) on a CPU machine, then every
module and name each imports anywhere (function bodies too); prints what fails, as JSON.

    .venv/bin/python tests/backends/gpu_module_import_check.py PATH...   # {path: [failure, ...]}

Run as its own process by test_gpu_module_imports.py: the GPU packages this machine lacks (vLLM,
flash-linear-attention; megatron-core where the megatron-cpu group is not installed) become stub
packages in this process only (an import check, not a test of those packages), so the module's
top level runs (`pytest.importorskip` gets the stub, a module-level "needs a
CUDA GPU" skip falls through) and each `oneloop` import is resolved for real.
"""

import ast
import importlib
import importlib.abc
import importlib.util
import json
import sys
import traceback
import types
from pathlib import Path

GUARDED = ("vllm", "megatron", "fla", "transformer_engine")  # the `gpu` extra and TE: device only
# Stubbed when missing: what the GPU modules import at their top level. TransformerEngine is never
# stubbed (an installed megatron-core probes for it and reads its version); its imports, inside
# functions only, are skipped when it is missing.
STUBBED = ("vllm", "megatron", "fla")


class _StubType(type):
    """Any attribute of a stub is another stub class; calling one returns it (decorators too)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})

    def __call__(cls, *_args, **_kwargs):
        return cls


class _StubModule(types.ModuleType):
    """A missing GPU package or one of its submodules: a package whose every name is a stub."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})


class _GuardFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `_StubModule`s for the roots in `missing` (and everything under them)."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = missing

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.missing:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        pass


def guard_gpu_imports() -> set[str]:
    """Stub the `STUBBED` packages not installed here, and let a module-level
    `pytest.skip(..., allow_module_level=True)` (no CUDA GPU here) fall through, so the rest of
    the module's top level runs too; returns the `GUARDED` names not installed here."""
    import pytest

    missing = {root for root in GUARDED if importlib.util.find_spec(root) is None}
    sys.meta_path.insert(0, _GuardFinder(missing & set(STUBBED)))
    skip = pytest.skip

    def no_module_skip(reason: str = "", *, allow_module_level: bool = False, **kwargs):
        if not allow_module_level:
            skip(reason, **kwargs)

    no_module_skip.Exception = skip.Exception  # type: ignore[attr-defined]
    pytest.skip = no_module_skip  # type: ignore[assignment]
    return missing


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every absolute import in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names if a.name != "*"], node.lineno))
    return found


def _resolve(module: str, names: list[str]) -> list[str]:
    """What of `from module import names` does not resolve (empty: all of it does)."""
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # any failure is the finding
        return [f"{module}: {type(error).__name__}: {error}"]
    failed = []
    for name in names:
        if hasattr(imported, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            failed.append(f"{module}.{name}: no such name or submodule")
    return failed


def check(path: Path, missing: set[str]) -> list[str]:
    """Import `path` as its own module (its folder first on sys.path, as pytest and a script run
    have it), then resolve every import it makes (but those of the `missing` packages); the
    failures, each with its line. Call `guard_gpu_imports` once first."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    failures = []
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException:  # any failure is the finding: a skip or SystemExit too
        failures.append(f"{path}: importing the module:\n{traceback.format_exc(limit=-8)}")
    for name, names, line in _imports(ast.parse(path.read_text(), str(path))):
        if name.split(".")[0] in missing:
            continue
        failures += [f"{path}:{line}: {failure}" for failure in _resolve(name, names)]
    return failures


if __name__ == "__main__":
    # One process for every module: each import of torch + transformers + oneloop costs seconds
    # on CI's two cores. The modules' names (file stems) are distinct: none shadows another.
    gpu_missing = guard_gpu_imports()
    report = {arg: check(Path(arg).resolve(), gpu_missing) for arg in sys.argv[1:]}
    print(json.dumps(report))
