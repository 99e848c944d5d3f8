"""Fault injection for tests, installed by tests: production code reads no switch for it.

A test that wants a fault in a process it starts (a server's engine process, a replica, a
tensor-parallel worker) passes ``fault_env(...)`` in that process's environment: it puts
``fault_site/`` first on ``PYTHONPATH``, whose ``sitecustomize`` (run by Python at start-up in
every process that inherits the environment) calls ``install`` with the faults named in
``TAILSERVE_TEST_FAULTS`` (tests import this module as ``fault_site.fault_injection``).
``install`` wraps tailserve's classes once the module defining them
is imported, so a process that never builds an engine never loads it:

* ``fail_forward_at_step=N``: ``EngineCore.step`` raises from its N-th call on (1-based), so a
  test sees what users get when the model fails mid-flight.
* ``slow_step_ms=MS``: each step's runner call takes MS longer (a sleep inside the step's
  measured time, after start-up's calibration): the step is slower for the same batch, as on a
  slower host.
* ``tp_hang_rank=R``: the tensor-parallel worker of rank R hangs where it loads the model
  (until killed), so a test sees what a hung worker does to start-up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "TAILSERVE_TEST_FAULTS"
SITE = Path(__file__).resolve().parent
SRC = SITE.parent.parent / "src"


def fault_env(**faults: float) -> dict[str, str]:
    """The environment entries that install ``faults`` in a process started with them (and
    in every process it starts)."""
    path = [str(SITE), str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), ENV: json.dumps(faults)}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Run ``patch(module)`` right after ``name`` is first executed."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            self.patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


def install(faults: dict[str, Any]) -> None:
    fail_at = faults.get("fail_forward_at_step")
    slow_s = float(faults.get("slow_step_ms", 0.0)) / 1e3
    hang_rank = faults.get("tp_hang_rank")

    def patch_core(module: ModuleType) -> None:
        if fail_at is None:
            return
        step = module.EngineCore.step
        calls = [0]

        def failing_step(self: Any) -> Any:
            calls[0] += 1
            if calls[0] >= fail_at:
                raise RuntimeError(f"injected forward failure at step {calls[0]}")
            return step(self)

        module.EngineCore.step = failing_step

    def patch_build(module: ModuleType) -> None:
        builder = module.EngineBuilder
        if slow_s > 0:
            build_engine = builder.build_engine

            def slow_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
                core = build_engine(self, *args, **kwargs)
                execute = core.runner.execute

                def slow_execute(sched: Any) -> Any:
                    time.sleep(slow_s)
                    return execute(sched)

                core.runner.execute = slow_execute
                return core

            builder.build_engine = slow_engine
        if hang_rank is not None:
            load = builder.load

            def hanging_load(self: Any, *args: Any, **kwargs: Any) -> Any:
                if self.rank == hang_rank:
                    self._step("load", "loading the model (hung by a test)")
                    threading.Event().wait()  # never set: hung, until rank 0 kills us
                return load(self, *args, **kwargs)

            builder.load = hanging_load

    _when_imported("tailserve.engine.core", patch_core)
    _when_imported("tailserve.engine.build", patch_build)


def install_from_environment() -> None:
    faults = os.environ.get(ENV)
    if faults:
        install(json.loads(faults))
