"""Shared fixtures: one local Ray runtime and one local-backend ServiceClient per test session."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

import oneloop  # noqa: E402,F401  (sets the offline environment defaults)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from oneloop.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def local_service(tmp_path_factory, tiny_model_path):
    """A local-backend ServiceClient on a real local Ray runtime (torch engines, CPU)."""
    from oneloop.backends import BackendConfig, connect

    run_dir = tmp_path_factory.mktemp("backend-runs")
    service = connect(
        BackendConfig(
            backend="local",
            run_dir=run_dir,
            local={"torch_threads": 1, "max_snapshots": 2},
        )
    )
    yield service
    service.close()
