"""Real `ddtree serve` processes on free loopback ports, started once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import API_KEY, Server, start_server


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server(logs) -> Iterator[Server]:
    """The embedded demo pair, as a newcomer runs it: `ddtree serve` with no model flags."""
    srv = start_server(logs, "--max-queue", "64", name="main")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def guarded_server(logs) -> Iterator[Server]:
    """One running request and a one-slot queue behind an API key (from the environment), for overload and
    auth tests: the second request waits in the queue, the third is refused."""
    srv = start_server(logs, "--max-queue", "1", "--max-num-seqs", "1", env={"DDTREE_API_KEY": API_KEY},
                       api_key=API_KEY, name="guarded")
    yield srv
    srv.stop()
