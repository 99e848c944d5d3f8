"""Shared fixtures: the default model loaded once per session (it takes ~10 s on 2 cores)."""

from __future__ import annotations

import gzip
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first
# imported, which any test module may do at collection (the runner imports the Triton
# backend). Without a GPU the Triton tests run under the interpreter, so set it before any
# test module is imported; a CUDA machine keeps compiling for real.
if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def no_arrival_risk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Schedules worked out without the step the arrival rate allows (ARRIVAL_RISK; its own
    tests in tests/test_arrival_watch.py): a long run of fake steps with nobody arriving
    would lift the cap they test."""
    from tailserve.engine import step_time

    monkeypatch.setattr(step_time, "ARRIVAL_RISK", 0.0)


@pytest.fixture
def itl_cap_only(monkeypatch: pytest.MonkeyPatch, no_arrival_risk: None) -> None:
    """Schedules worked out for the ITL SLO's cap alone: without the floor of
    FIXED_COST_MULTIPLE x the fake model's 10 ms fixed cost (100 ms), which
    tests/test_scheduler_time.py::test_a_lone_prompt_on_a_heavy_model_is_not_cut_into_tiny_steps
    tests on its own, nor the arrival rate's step (``no_arrival_risk``)."""
    from tailserve.engine import step_time

    monkeypatch.setattr(step_time, "FIXED_COST_MULTIPLE", 0.0)


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """For tests of the compiled CPU kernels (``pytest.mark.usefixtures("cpu_kernels")``).

    They skip only where the kernels cannot be built and are not asked for (no C++ compiler):
    where a compiler runs, or with TAILSERVE_REQUIRE_CPU_KERNELS=1 (.ci/run), a failed build
    fails them, so the fast path is never left untested by accident.
    """
    from tailserve.kernels import cpu_ops_available, cpu_ops_error, cpu_ops_required

    if cpu_ops_available():
        return
    reason = f"CPU kernels not available: {cpu_ops_error()}"
    if cpu_ops_required():
        pytest.fail(f"{reason}; they are required on this host (a C++ compiler runs here, or "
                    "TAILSERVE_REQUIRE_CPU_KERNELS=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_loaded() -> Any:
    from tailserve.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def default_bf16_folder(default_loaded: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bundled model as a bf16 Hugging Face folder (safetensors, config.json, tokenizer),
    written once per session from the loader's float32 dequantization of the GGUF."""
    import torch

    from tiny_models import save_default_model_as_hf

    return save_default_model_as_hf(tmp_path_factory.mktemp("smol-bf16"), torch.bfloat16,
                                    default_loaded)


@pytest.fixture(scope="session")
def hf_default() -> Any:
    """transformers' own GGUF loading of the bundled model: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    from tailserve.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def default_llm(default_loaded: Any) -> Any:
    """An LLM over the default model, sharing the session's loaded weights."""
    from tailserve import LLM

    return LLM.from_loaded(default_loaded, dtype="float32", kv_cache_memory=0.5)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (SmolLM2's tokenizer) as an HF folder: a fast engine for server
    tests whose subject is the HTTP edge, not the answers."""
    from tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def otlp_collector() -> Iterator[tuple[str, list[bytes]]]:
    """A real HTTP server collecting OTLP/HTTP protobuf POST bodies."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/traces":
                bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    finally:
        server.shutdown()
        server.server_close()


# The headless browser of the dashboard and watch pages' tests (Debian's chromium, driven by
# playwright): one per test module.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (make setup-browser installs Debian's chromium)")
    with sync_api.sync_playwright() as pw:
        try:
            b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                                   timeout=30000)
        except Exception as exc:
            pytest.skip(f"chromium cannot launch: {str(exc).splitlines()[0]}")
        yield b
        b.close()
