"""The house rules of the layout, checked on the source (issue 17): every module of the package is
at most 600 lines, no private name is imported from another file, and imports point down the layers
(the loop → backends' front door and agents; front doors → runtime → engines → weight sync; nothing
imports the loop; the serve codec never reaches back up to `oneloop.backends.connect`)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "oneloop"
MAX_MODULE_LINES = 600
LOCAL = "oneloop.backends.megatron_local"
FRONT_DOORS = tuple(
    f"{LOCAL}.{name}" for name in ("service_client", "training_client", "sampling_client", "serve")
)
RUNTIME = tuple(
    f"{LOCAL}.{name}"
    for name in (
        "actors", "routing", "publish", "checkpoints", "models", "lora_serving", "futures",
        "sample_batch", "losses",
    )
)

# (importer prefix, imported prefixes it must not reach, why). A prefix matches the module itself
# and everything below it; "=oneloop.backends" matches that one module (the package's `connect`).
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("oneloop.errors", ("oneloop.",), "the error hierarchy is a leaf"),
    ("oneloop.tiny", ("oneloop.loop", "oneloop.backends", "oneloop.agents", "oneloop.diagnostics"),
     "the tiny demo model is a leaf the backends may build"),
    ("oneloop.agents", ("oneloop.loop", "oneloop.diagnostics", "oneloop.cli", f"{LOCAL}",
                        "oneloop.backends.tinker_remote"),
     "agents see only Tinker types, never the loop or a backend's insides"),
    ("oneloop.backends", ("oneloop.loop", "oneloop.diagnostics", "oneloop.cli", "oneloop.agents"),
     "components never import the loop"),
    ("oneloop.loop",
     (LOCAL, "oneloop.backends.tinker_remote", "oneloop.diagnostics", "oneloop.cli"),
     "the loop talks to backends through connect() and the Tinker surface only"),
    (f"{LOCAL}.serve", ("=oneloop.backends",), "serve builds the local service itself"),
    (f"{LOCAL}.engines", ("=oneloop.backends",) + FRONT_DOORS + RUNTIME,
     "engines sit below the runtime and the front doors"),
    (f"{LOCAL}.weight_sync", ("=oneloop.backends", f"{LOCAL}.engines") + FRONT_DOORS + RUNTIME,
     "weight sync sits below the engines"),
    *[(runtime, FRONT_DOORS, "the runtime sits below the front doors") for runtime in RUNTIME],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import in the file, lazy ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_name(path).split(".")
                base = base[: len(base) - node.level + (path.name == "__init__.py")]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
    return found


def matches(module: str, prefix: str) -> bool:
    if prefix.startswith("="):
        return module == prefix[1:]
    return module == prefix.rstrip(".") or module.startswith(prefix.rstrip(".") + ".")


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_above_the_size_limit() -> None:
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in package_files()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules above {MAX_MODULE_LINES} lines: {too_long}"


def test_no_relative_imports_in_the_package() -> None:
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in package_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, f"relative imports (use absolute ones): {relative}"


@pytest.mark.parametrize("folder", ["oneloop", "scripts", "benchmarks", "tests"])
def test_no_private_name_imported_across_files(folder: str) -> None:
    """A helper two files share has one public home; `from x import _helper` hides the sharing."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {module}.{name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module, names in imports(path)
        if module.startswith("oneloop")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not offenders, f"private names imported across files: {offenders}"


def test_imports_point_down_the_layers() -> None:
    violations = []
    for path in package_files():
        importer = module_name(path)
        for importer_prefix, forbidden, why in RULES:
            if not matches(importer, importer_prefix):
                continue
            for line, module, _ in imports(path):
                if matches(module, importer_prefix):
                    continue  # inside its own layer
                for prefix in forbidden:
                    if matches(module, prefix):
                        violations.append(
                            f"{path.relative_to(ROOT)}:{line} imports {module} ({why})"
                        )
    assert not violations, "\n".join(violations)


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checks above can fail: the rule matcher flags an engine importing a front door."""
    assert matches(f"{LOCAL}.training_client", f"{LOCAL}.training_client")
    assert matches("oneloop.backends", "=oneloop.backends")
    assert not matches("oneloop.backends.config", "=oneloop.backends")
    assert not matches(f"{LOCAL}.engines_extra", f"{LOCAL}.engines")
    engine_rule = next(rule for rule in RULES if rule[0] == f"{LOCAL}.engines")
    assert any(matches(f"{LOCAL}.training_client", prefix) for prefix in engine_rule[1])


def test_the_slowest_files_listed_for_scheduling_exist() -> None:
    """conftest.SLOWEST_FILES orders the suite; a renamed file would silently drop out of it."""
    from tests.conftest import SLOWEST_FILES

    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
    assert [p for p in SLOWEST_FILES if not (ROOT / p).is_file()] == []


def test_ruff_finds_nothing(tmp_path: Path) -> None:
    """STYLE.md's linter, run the way pyproject.toml configures it (line length 100, E F I UP B),
    on every Python file of the repository; and it is really checking: a file with an unused
    import and a 101-character line is flagged."""
    import subprocess
    import sys

    def ruff(*paths: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
             "--config", str(ROOT / "pyproject.toml"), *map(str, paths)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    found = ruff(ROOT)
    assert found.returncode == 0, f"ruff check:\n{found.stdout}{found.stderr}"
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + "x = " + "1" * 97 + "\n")
    flagged = ruff(bad)
    assert flagged.returncode == 1 and "F401" in flagged.stdout and "E501" in flagged.stdout
