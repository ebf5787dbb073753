"""What the serve tests share: the local backend a module's server runs on."""

import pytest

from oneloop.backends import BackendConfig, connect


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """A local backend on the tiny model (one torch thread), one per test module, closed after."""
    svc = connect(
        BackendConfig(
            backend="local",
            run_dir=tmp_path_factory.mktemp("serve_backend"),
            local={"torch_threads": 1},
        )
    )
    yield svc
    svc.close()
