"""Before the clock starts: check the URL, the key and the model, and learn what the server
offers besides the OpenAI API (/tokenize, /metrics, /debug/timeline).

Blocking stdlib HTTP (``SyncHTTP``), because this phase (and /tokenize while a dataset is
built) runs before any load and needs no event loop. Every network failure becomes a
``BenchError`` that says what to check, never a traceback.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from tailserve.bench import BenchError
from tailserve.bench.client import describe_http_error
from tailserve.bench.goodput import published_slos
from tailserve.bench.observe import available_gauges, parse_metrics


class SyncHTTP:
    """Blocking JSON over one kept-alive connection, for the pre-flight and /tokenize.

    Network failures become ``BenchError`` with what to check, never a traceback.
    """

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"--base-url must look like http://HOST:PORT, got {base_url!r}")
        self.base_url = base_url
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        try:
            self.port = parts.port or (443 if self.https else 80)
        except ValueError:
            raise BenchError(f"--base-url has a bad port: {base_url!r}") from None
        self.prefix = parts.path.rstrip("/")
        self.headers = headers
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {**self.headers, **({"Content-Type": "application/json"} if data else {})}
        for attempt in (0, 1):
            reused = self._conn is not None
            conn = self._conn or self._connect()
            self._conn = conn
            try:
                conn.request(method, self.prefix + path, body=data, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                self._conn = None
                if reused and attempt == 0:
                    continue  # the server closed an idle kept-alive connection: reconnect
                raise BenchError(
                    f"{self.base_url} closed the connection on {method} {path}"
                ) from None
            except ConnectionRefusedError:
                self.close()
                raise BenchError(
                    f"connection refused at {self.host}:{self.port}: nothing is listening "
                    f"there. Is the server running, and is --base-url {self.base_url} right?"
                ) from None
            except socket.gaierror:
                self.close()
                raise BenchError(
                    f"cannot resolve the host {self.host!r} of --base-url {self.base_url}"
                ) from None
            except TimeoutError:
                self.close()
                raise BenchError(
                    f"{self.base_url} did not answer {method} {path} within {self.timeout_s:g} s"
                ) from None
            except OSError as exc:
                self.close()
                raise BenchError(f"cannot reach {self.base_url}: {exc.strerror or exc}") from None
        raise AssertionError("unreachable")

    def get_json(self, path: str) -> tuple[int, Any]:
        status, raw = self.request("GET", path)
        return status, _json_or_none(raw)

    def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        status, raw = self.request("POST", path, body)
        return status, _json_or_none(raw)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


@dataclass
class ServerInfo:
    """What the pre-flight learned. The tailserve-only parts are used only where present."""

    base_url: str
    model: str
    served_models: list[str]
    version: str | None = None
    max_model_len: int | None = None
    has_tokenize: bool = False
    metrics_names: list[str] = field(default_factory=list)  # the gauges /metrics has
    has_timeline: bool = False
    # The server's default SLOs from its /metrics gauges (kind -> ms; bench/goodput.py).
    published_slos: dict[str, float] = field(default_factory=dict)
    # /v1/models' owned_by ("vllm", "llamacpp", ...): which engine, when /metrics does not say.
    owned_by: list[str] = field(default_factory=list)


def normalize_base_url(url: str) -> str:
    """The server root. People paste the OpenAI base URL (``.../v1``); accept it."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def preflight(http: SyncHTTP, model: str | None, api_key: str | None) -> ServerInfo:
    """Check the URL, the key and the model before the clock starts; learn what the server
    offers besides the API (/tokenize, /metrics, /debug/timeline)."""
    where = http.base_url
    status, raw = http.request("GET", "/v1/models")
    if status in (401, 403):
        _, msg = describe_http_error(status, raw, None)
        hint = ("the key given with --api-key (or OPENAI_API_KEY) is not accepted"
                if api_key else "the server wants an API key: pass --api-key or set "
                "OPENAI_API_KEY")
        raise BenchError(f"{where} refused the request ({msg}): {hint}")
    if status == 404:
        raise BenchError(
            f"GET {where}/v1/models answered 404: {where} is not the root of an "
            "OpenAI-compatible server. --base-url wants the server root, e.g. "
            "http://127.0.0.1:8000 (with or without /v1)"
        )
    body = _json_or_none(raw)
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise BenchError(
            f"GET {where}/v1/models answered HTTP {status} "
            f"{raw[:200].decode('utf-8', 'replace')!r}: not an OpenAI-compatible server?"
        )
    served = [str(m.get("id")) for m in body["data"] if isinstance(m, dict) and m.get("id")]
    if model is None:
        if not served:
            raise BenchError(f"{where} serves no models; pass --model")
        model = served[0]
    elif served and model not in served:
        raise BenchError(f"{where} does not serve model {model!r}; it serves {served}")
    info = ServerInfo(base_url=where, model=model, served_models=served,
                      owned_by=sorted({str(m["owned_by"]) for m in body["data"]
                                       if isinstance(m, dict) and m.get("owned_by")}))

    status, body = http.get_json("/version")
    if status == 200 and isinstance(body, dict) and "version" in body:
        info.version = str(body["version"])
    status, raw = http.request("POST", "/tokenize", {"model": model, "prompt": "Hello world"})
    body = _json_or_none(raw)
    if status == 200 and isinstance(body, dict) and isinstance(body.get("count"), int):
        info.has_tokenize = True
        mml = body.get("max_model_len")
        info.max_model_len = int(mml) if isinstance(mml, int) else None
    status, raw = http.request("GET", "/metrics")
    if status == 200:
        text = raw.decode("utf-8", "replace")
        info.metrics_names = available_gauges(text)
        info.published_slos = published_slos(parse_metrics(text))
    status, body = http.get_json("/debug/timeline?limit=1")
    info.has_timeline = status == 200 and isinstance(body, dict) and "records" in body
    return info
