from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    """Prefect's real local server (temporary, SQLite), for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
