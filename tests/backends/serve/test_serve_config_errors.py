"""`oneloop serve`'s configuration errors (issue 21, item 5): every bad `--backend-config`, a wrong
`models:` directory and a busy port are one line naming the file, field or port, before anything
starts (no Ray, no traceback), and both forms of the backend file are accepted."""

import json
import socket
from pathlib import Path

import pytest

from oneloop.backends.megatron_local.serve.server import parse_args, serve_main
from oneloop.errors import ConfigError


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_args(argv)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_backend_file_bare_and_wrapped_forms_are_the_same(tmp_path):
    section = {"backend": "local", "run_dir": str(tmp_path / "runs"),
               "local": {"torch_threads": 1}}
    bare = tmp_path / "bare.yaml"
    bare.write_text(json.dumps(section))  # JSON is YAML
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"backend": section}))
    from_bare = parse_args(["--backend-config", str(bare)]).backend
    from_wrapped = parse_args(["--backend-config", str(wrapped)]).backend
    assert from_bare == from_wrapped
    assert from_bare.local.torch_threads == 1 and from_bare.run_dir == tmp_path / "runs"


def test_backend_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert _error(["--backend-config", str(missing)]) == (
        f"--backend-config {missing}: no such file")

    text = tmp_path / "backend.txt"
    text.write_text("backend: local\n")
    assert str(text) in _error(["--backend-config", str(text)])
    assert ".yaml, .yml or .json" in _error(["--backend-config", str(text)])

    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    assert _error(["--backend-config", str(directory)]).startswith(
        f"--backend-config {directory}: cannot read it")

    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{backend: local")
    assert _error(["--backend-config", str(bad_json)]).startswith(
        f"--backend-config {bad_json}: not valid JSON")

    bad_yaml = tmp_path / "bad.yml"
    bad_yaml.write_text("backend: [local\nmodels: {\n")
    assert _error(["--backend-config", str(bad_yaml)]).startswith(
        f"--backend-config {bad_yaml}: not valid YAML")

    listed = tmp_path / "list.yaml"
    listed.write_text("- backend\n")
    assert "expected a mapping" in _error(["--backend-config", str(listed)])

    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("backend: {backend: local}\nmodels: {}\n")
    assert "also found: models" in _error(["--backend-config", str(mixed)])

    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("backend: {backend: local, lcal: {}}\n")
    assert _error(["--backend-config", str(unknown)]).startswith("backend.lcal:")


def test_a_wrong_models_directory_is_refused_at_startup(tmp_path):
    config = tmp_path / "backend.yaml"
    config.write_text(f"models:\n  qwen: {tmp_path / 'no-such-model'}\n")
    assert _error(["--backend-config", str(config)]) == (
        f"backend.models.qwen: {tmp_path / 'no-such-model'} is not a directory (expected a "
        "local Hugging Face model directory)")
    (tmp_path / "empty").mkdir()
    config.write_text(f"models:\n  qwen: {tmp_path / 'empty'}\n")
    assert "backend.models.qwen: " in _error(["--backend-config", str(config)])
    assert "has no config.json" in _error(["--backend-config", str(config)])


def test_serve_main_answers_config_errors_with_one_line_and_status_2(tmp_path, capsys):
    assert serve_main(["--backend-config", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.json: no such file" in err
    assert "Traceback" not in err


def test_a_busy_port_fails_at_once_naming_the_port(tmp_path, capsys):
    """Regression: the server printed "oneloop serve on http://..." and failed 14 s later with
    uvicorn's errno 98. Now the port is bound first (before the backend, so no Ray starts)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        status = serve_main(["--port", str(port), "--run-dir", str(tmp_path / "runs")])
    finally:
        holder.close()
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.count("\n") == 1
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in captured.err
    assert "oneloop serve on" not in captured.err + captured.out
    assert not Path(tmp_path / "runs").exists()  # the backend never started
