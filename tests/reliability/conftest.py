"""The reliability suite (``make reliability``): the outside attack run of issue 18 as tests.

Real ``tailserve serve`` processes on loopback, tiny random models (the subject is the server,
not the answers). Not collected by the default ``pytest`` run (``norecursedirs`` in
pyproject.toml); ``make reliability`` runs it under a time bound. Each test records its
figures with the ``figures`` fixture; they are printed at the end of the run (the numbers
benchmarks/notes/server.md quotes).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

_FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny model with an 8192-token context: requests that run long enough to interrupt."""
    from tiny_models import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("rel-long") / "llama", max_position_embeddings=8192
    )


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A dict for this test's measured figures, printed in the run's summary."""
    return _FIGURES.setdefault(request.node.name, {})


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for name, values in _FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(values, sort_keys=True)}")
