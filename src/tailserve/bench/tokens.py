"""How long a text is in the target model's tokens, and text of a given token length.

Sources, best first (``make_counter``):

1. ``--tokenizer PATH``: a local HF folder or ``.gguf`` file (``default``: the bundled model);
2. the server's ``POST /tokenize`` (tailserve and vLLM have it), so lengths are the server's;
3. otherwise an estimate of 4 characters per token. The result says so
   (``tailserve.tokenizer.exact`` is false), because every length is then a guess.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tailserve.bench import BenchError

if TYPE_CHECKING:
    from tailserve.bench.preflight import SyncHTTP

# Common English words: each is one token (with its leading space) in the BPE vocabularies of
# the Llama family, so a prompt of n words is about n tokens and a length is hit in one or two
# counts. Drawn at random, two prompts share a whole KV block only by chance (16 equal words
# in a row), so the random datasets do not hit the prefix cache by accident.
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should world high every near add food between own below "
    "country plant last school father keep tree never start city earth eye light thought "
    "head under story saw left few while along might close something seem next hard open "
    "example begin life always those both paper together got group often run important "
    "until children side feet car mile night walk white sea began grow took river four "
    "carry state once book hear stop without second later miss idea enough eat face watch "
    "far really almost let above girl sometimes mountain cut young talk soon list song "
    "being leave family"
)
WORDS = _WORD_TEXT.split()


class TokenCounter(Protocol):
    source: str  # says where lengths come from, for the result file
    exact: bool  # False for the character estimate

    def count(self, text: str) -> int: ...


class LocalCounter:
    exact = True

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.source = f"local tokenizer {name}"

    def count(self, text: str) -> int:
        # Special tokens included, as the server counts a completions prompt.
        return len(self.tokenizer(text).input_ids)


class ServerCounter:
    exact = True

    def __init__(self, http: SyncHTTP, model: str) -> None:
        self.http = http
        self.model = model
        self.source = f"server {http.base_url}/tokenize"

    def count(self, text: str) -> int:
        status, body = self.http.post_json("/tokenize", {"model": self.model, "prompt": text})
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("count"), int):
            raise BenchError(f"POST /tokenize answered HTTP {status}: {str(body)[:200]}")
        return int(body["count"])


class ApproxCounter:
    exact = False
    CHARS_PER_TOKEN = 4.0
    source = "estimate: 4 characters per token (no tokenizer: pass --tokenizer for exact lengths)"

    def count(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.CHARS_PER_TOKEN))


def make_counter(tokenizer: str | None, http: SyncHTTP, model: str,
                 server_has_tokenize: bool) -> TokenCounter:
    if tokenizer is not None:
        from tailserve.errors import ModelLoadError
        from tailserve.model.loader import load_tokenizer

        path = None if tokenizer == "default" else tokenizer
        try:
            return LocalCounter(load_tokenizer(path), tokenizer)
        except (ModelLoadError, OSError) as exc:
            raise BenchError(f"--tokenizer {tokenizer}: {exc}") from None
    if server_has_tokenize:
        return ServerCounter(http, model)
    return ApproxCounter()


class PromptSynth:
    """Random word text of a target token length, measured with the counter.

    The length is corrected until it matches (at most a few counts: words are about one token
    each); where a tokenizer cannot hit it exactly (e.g. a BOS token and a target of 1), the
    closest text is returned with its true count, never a wrong claimed length.
    """

    MAX_TRIES = 6

    def __init__(self, counter: TokenCounter, rng: np.random.Generator) -> None:
        self.counter = counter
        self.rng = rng
        self._ratio: float | None = None  # tokens per word, measured once

    def ratio(self) -> float:
        if self._ratio is None:
            words = self._words(256)
            self._ratio = max(0.1, self.counter.count(" ".join(words)) / len(words))
        return self._ratio

    def _words(self, n: int) -> list[str]:
        idx = self.rng.integers(0, len(WORDS), size=n)
        return [WORDS[i] for i in idx]

    def text(self, num_tokens: int) -> tuple[str, int]:
        if num_tokens < 1:
            raise BenchError(f"a prompt needs at least 1 token, asked for {num_tokens}")
        ratio = self.ratio()
        n = max(1, round(num_tokens / ratio))
        pool = self._words(n + n // 4 + 16)
        best: tuple[int, str, int] | None = None  # (distance, text, count)
        for _ in range(self.MAX_TRIES):
            if n > len(pool):
                pool += self._words(n - len(pool) + 16)
            text = " ".join(pool[:n])
            c = self.counter.count(text)
            if best is None or abs(c - num_tokens) < best[0]:
                best = (abs(c - num_tokens), text, c)
            if c == num_tokens:
                break
            step = round((num_tokens - c) / ratio)
            n = max(1, n + (step if step != 0 else (1 if c < num_tokens else -1)))
        assert best is not None  # MAX_TRIES >= 1
        return best[1], best[2]
