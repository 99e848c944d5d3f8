"""The engine process: load the model, then loop (inputs from ZMQ -> step -> messages out).

Started by ``MPEngineClient`` (``engine/mp_client.py``) with the ``spawn`` method. It
connects a PULL socket for inputs and a PUSH socket for messages to IPC paths the API
process bound in a private directory; only msgpack crosses them. It exits when told to, when
its parent dies, or (non-zero) when the model fails.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from tailserve.config import EngineArgs
from tailserve.engine.messages import (
    EngineInput,
    EngineMessage,
    StartupFailed,
    input_decoder,
    message_encoder,
)
from tailserve.glibc import glibc

logger = logging.getLogger("tailserve.engine")


def engine_main(
    engine_args: dict[str, Any], input_addr: str, output_addr: str, log_level: str = "INFO"
) -> None:
    """Entry point of the engine process (never returns normally: exits with a status)."""
    logging.basicConfig(
        level=log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s"
    )
    # SIGINT goes to the whole process group on Ctrl-C, and supervisors send SIGTERM to every
    # process of the service at once (systemd's KillMode=control-group, `kill -- -PGID`). The
    # API process drains first and then tells us to stop (or kills us after its timeout), so
    # neither signal may take the engine away from under the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)

    def emit(msg: EngineMessage) -> None:
        out.send(message_encoder.encode(msg), copy=False)

    status = 0
    try:
        status = _run(engine_args, inputs, emit, parent)
    finally:
        inputs.close(linger=0)
        out.close()
        ctx.term()
    sys.exit(status)


def _run(engine_args: dict[str, Any], inputs: zmq.Socket, emit: Any, parent: int) -> int:
    # llguidance's tokenizer (the model's tokenizer loaded for it, then converted: 2-5 s on a
    # loaded 2-core host) in a thread beside the load, so that no constrained request waits
    # for it and start-up waits for what is left of it only.
    # transformers' lazy top-level module is not thread-safe: the thread and the load below
    # resolving ``AutoTokenizer`` at once once got a half-initialized module (ImportError:
    # cannot import name 'AutoTokenizer', a fresh clone's first server). Both threads' names
    # are resolved here first, so neither imports while the other does.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    from tailserve.engine.core import EngineCore
    from tailserve.engine.loop import EngineLoop, drive
    from tailserve.engine.structured_output import lltokenizer_from_hf  # noqa: F401
    from tailserve.model.loader import load_tokenizer  # noqa: F401

    pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
    grammar_tokenizer = pool.submit(_grammar_tokenizer, engine_args.get("model"))
    pool.shutdown(wait=False)
    try:
        # No tokenizer here: the API process tokenizes and detokenizes.
        core = EngineCore.from_args(EngineArgs(**engine_args), with_tokenizer=False,
                                    grammar_tokenizer=grammar_tokenizer)
    except Exception as exc:
        from tailserve.model.parallel import TensorParallelError

        # ValueErrors (load / config problems) and TensorParallelErrors (a rank failed or hung
        # at start-up, named) are ours and written for users; anything else is reported by
        # type only, never with paths or addresses from a traceback.
        ours = isinstance(exc, (ValueError, TensorParallelError))
        if ours:
            logger.error("engine start-up failed: %s", exc)
        else:
            logger.exception("engine start-up failed")
        text = str(exc) if ours else f"{type(exc).__name__} at start-up"
        emit(StartupFailed(text))
        return 1
    _trim_heap()
    loop = EngineLoop(core, emit)
    emit(loop.ready_message())
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)

    busy = [False]

    def wait_for_inputs(timeout_s: float) -> list[EngineInput]:
        if timeout_s > 0 and busy[0]:  # the last request just finished: the engine is idle
            _trim_heap()
        busy[0] = timeout_s == 0
        batch: list[EngineInput] = []
        if poller.poll(int(timeout_s * 1000)):
            while True:
                try:
                    raw = inputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                batch.append(input_decoder.decode(raw.buffer))
        return batch

    def parent_gone() -> bool:
        # The API process is gone (killed): do not linger as an orphan, busy or not. A
        # getppid() per iteration costs about a microsecond.
        if os.getppid() == parent:
            return False
        logger.warning("API process exited; engine stopping")
        return True

    try:
        return drive(loop, wait_for_inputs, parent_gone)
    finally:
        core.close()


def _grammar_tokenizer(model: str | None) -> Any:
    from tailserve.engine.structured_output import lltokenizer_from_hf
    from tailserve.model.loader import load_tokenizer

    t0 = time.perf_counter()
    tokenizer = lltokenizer_from_hf(load_tokenizer(model))
    logger.info("structured output: tokenizer built in %.2f s", time.perf_counter() - t0)
    return tokenizer


def _trim_heap() -> None:
    """Give freed heap pages back to the OS: after start-up (the released checkpoint, the
    loader's and calibration's temporaries) and each time the engine goes idle (the steps'
    activations). glibc keeps freed small and mid-sized blocks in its arenas (the bundled
    model: 48 MB after start-up, benchmarks/resident_memory.py). Measured on the bundled
    model: 9 ms after start-up, 0.4-1.7 ms on going idle after a 1,000-token request (a request
    arriving meanwhile waits that long); never inside a busy stretch; a no-op without glibc."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
