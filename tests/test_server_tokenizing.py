"""Live: huge prompts are refused by their byte length before tokenizing (400 with the
numbers), and one being tokenized does not hold /health (the tokenize pool, off the loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from server_util import ServerProcess

# 32768 tokens x 82 bytes (SmolLM2's longest token + 1): the byte bound, under the 4 MiB body.
MAX_MODEL_LEN = 32768
BOUND = MAX_MODEL_LEN * 82
NO_KEY_ENV = {"TAILSERVE_API_KEY": ""}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tiny_models import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("long") / "llama",
                             max_position_embeddings=MAX_MODEL_LEN)
    with ServerProcess(["--max-model-len", str(MAX_MODEL_LEN)], model=model,
                       env=NO_KEY_ENV) as srv:
        yield srv


@pytest.mark.parametrize(("path", "field", "param"), [
    ("/v1/completions", "prompt", "prompt"),
    ("/v1/chat/completions", "messages", "messages"),
    ("/tokenize", "prompt", "prompt"),
])
def test_text_over_the_byte_bound_is_a_400(
    server: ServerProcess, path: str, field: str, param: str
) -> None:
    text = "a" * (BOUND + 1)
    value: object = [{"role": "user", "content": text}] if field == "messages" else text
    r = httpx.post(server.url + path, json={field: value, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"] == (
        f"{param} is {BOUND + 1} bytes of text, more than {BOUND} (max_model_len "
        f"{MAX_MODEL_LEN} x 82 bytes, the longest token): it cannot fit in max_model_len tokens")


def test_health_answers_while_a_huge_prompt_is_tokenized(server: ServerProcess) -> None:
    """Two texts just under the bound (about a second each to tokenize) on /tokenize; /health
    polled meanwhile. On the event loop no /health could complete between the moment the
    server starts tokenizing and the huge responses; off it, many do."""
    # Words, so it is as slow per byte as prose and well over 32768 tokens: /tokenize answers.
    text = ("lorem ipsum dolor sit amet " * (BOUND // 27))[:BOUND]

    async def scenario() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            huge = [asyncio.create_task(client.post("/tokenize", json={"prompt": text}))
                    for _ in range(2)]
            healthy = 0
            while not all(t.done() for t in huge):
                r = await client.get("/health")
                assert r.status_code == 200
                if not any(t.done() for t in huge):
                    healthy += 1
            counts = [t.result().json()["count"] for t in huge]
            assert counts[0] == counts[1] > MAX_MODEL_LEN
            return healthy, counts[0]

    healthy, _ = asyncio.run(scenario())
    # A /health round trip is milliseconds; the tokenizing is about a second.
    assert healthy >= 20, healthy


def test_the_tokenize_pool_needs_a_worker() -> None:
    from tailserve.errors import ConfigError
    from tailserve.server.settings import ServerSettings

    assert ServerSettings().tokenizer_workers == 2
    with pytest.raises(ConfigError) as e:
        ServerSettings(tokenizer_workers=0)
    assert str(e.value) == "tokenizer_workers must be >= 1, got 0"


def test_the_tokenize_threads_yield_to_the_engine_and_the_loop() -> None:
    """The pool's threads run ``tokenizer_nice`` below the process (the event loop's thread
    and the engine keep its priority); the setting is checked."""
    import os
    import threading

    from tailserve.errors import ConfigError
    from tailserve.server.context import tokenize_pool
    from tailserve.server.settings import ServerSettings

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = niceness()
    pool = tokenize_pool(2, ServerSettings().tokenizer_nice)
    try:
        assert {pool.submit(niceness).result() for _ in range(4)} == {min(19, base + 5)}
    finally:
        pool.shutdown()
    assert niceness() == base
    with pytest.raises(ConfigError) as e:
        ServerSettings(tokenizer_nice=20)
    assert str(e.value) == "tokenizer_nice must be in [0, 19], got 20"
