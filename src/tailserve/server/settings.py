"""ServerSettings: the HTTP side of ``tailserve serve`` (FastAPI-free, so the CLI can build its
flags without importing the server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tailserve.errors import ConfigError
from tailserve.obs.timeline import DEFAULT_MAXLEN as DEFAULT_TIMELINE_MAXLEN
from tailserve.server.reasoning import ReasoningParserName


@dataclass
class ServerSettings:
    """The HTTP side of ``tailserve serve``; its flags are generated from these fields
    (cli_flags.py), so each default lives here only."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(
        default=None, metadata={"help": "require 'Authorization: Bearer KEY' (or set "
                                "TAILSERVE_API_KEY)"})
    api_keys: str | None = field(
        default=None, metadata={"help": "a keys file (one JSON object a line: key, name, and "
                                "optional weight, max_concurrency, max_requests_per_s): each "
                                "key names its tenant; see docs/tenants.md"})
    tenant_header: str | None = field(
        default=None, metadata={"help": "take the tenant's name from this request header "
                                "(only behind a proxy you trust to set it)"})
    cache_salt_by_tenant: bool = field(
        default=False, metadata={"help": "salt every request's prefix-cache blocks with its "
                                 "tenant, so tenants never share (or probe) cached prompts"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "the name clients use as model"})
    max_request_bytes: int = field(
        default=4 << 20, metadata={"help": "larger bodies get 413"})
    max_header_bytes: int = field(
        default=16 << 10, metadata={"help": "larger headers get 431"})
    header_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a connection may take to send a request's headers; slower "
                  "ones get 408 and are closed"})
    shutdown_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds SIGTERM waits for in-flight requests before aborting them"})
    tokenizer_workers: int = field(
        default=2,
        metadata={"help": "threads that tokenize and template prompts, off the event loop, so "
                  "a huge prompt does not stall /health and running streams"})
    tokenizer_nice: int = field(
        default=5,
        metadata={"help": "niceness added to the tokenizer threads: when the engine and the "
                  "API are both busy, the engine (what admitted requests wait on) and the "
                  "event loop (/health, refusals, streams) come first, bulk tokenizing last"})
    timeline: str | None = field(
        default=None, metadata={"help": "append step and request records (JSONL)"})
    timeline_buffer: int = field(
        default=DEFAULT_TIMELINE_MAXLEN,
        metadata={"help": "records kept in memory for GET /debug/timeline"})
    otlp_traces_endpoint: str | None = field(
        default=None,
        metadata={"help": "OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces"})
    watchdog_timeout: float = field(
        default=30.0,
        metadata={"help": "/health turns 503 after this long without engine progress"})
    enable_vllm_metrics: bool = field(
        default=True,
        metadata={"help": "also export the gauges routers read under vLLM's names "
                  "(vllm:num_requests_running, vllm:num_requests_waiting, "
                  "vllm:kv_cache_usage_perc, vllm:cache_config_info)"})
    retry_after_s: int = field(default=1, metadata={"cli": False})
    enable_profiling: bool = field(
        default=False, metadata={"help": "allow POST /debug/profile?seconds=N (torch.profiler "
                                 "trace of the engine)"})
    profile_dir: str | None = field(
        default=None,
        metadata={"help": "where profile traces go (default: <tmp>/tailserve-profiles)"})
    grammar_timeout_ms: float = field(
        default=500.0,
        metadata={"help": "a structured-output grammar (JSON schema, regex, choice, Lark/GBNF) "
                  "whose compile and first mask take longer is refused with a 400 naming the "
                  "figure; verdicts are cached per grammar"})
    reasoning_parser: ReasoningParserName | None = field(
        default=None,
        metadata={"help": "put chat answers' thinking (the text in think tags) into "
                  "reasoning_content: deepseek_r1 (all before the closing tag) or qwen3 (only "
                  "an answer that opens with the tag); unset: the text is all content"})
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    def __post_init__(self) -> None:
        if not self.header_timeout > 0:  # written so that NaN fails it too
            raise ConfigError(f"header_timeout must be > 0 seconds, got {self.header_timeout}")
        if not 0 <= self.tokenizer_nice <= 19:
            raise ConfigError(f"tokenizer_nice must be in [0, 19], got {self.tokenizer_nice}")
        if not self.grammar_timeout_ms > 0:
            raise ConfigError(f"grammar_timeout_ms must be > 0, got {self.grammar_timeout_ms}")
        if self.tokenizer_workers < 1:
            raise ConfigError(f"tokenizer_workers must be >= 1, got {self.tokenizer_workers}")
