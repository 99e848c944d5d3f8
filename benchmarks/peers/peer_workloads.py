"""Workloads users have, for benchmarks/serving_peers.py: a chat-like length distribution and a
multi-turn agent-like one, written as JSONL files that both clients send as they are
(vLLM's ``--dataset-name custom``, ``tailserve bench --dataset jsonl``).

Lengths are drawn first (pure numpy, seeded: ``chat_lengths``, ``agent_sessions``), then
turned into word text of exactly those lengths in the bundled model's tokens (``write_*``).

**chat** -- ShareGPT-like single requests. Prompt and output lengths are lognormal with the
mean and standard deviation published for ShareGPT in LMSYS-Chat-1M's Table 1 (Zheng et al.,
"LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation Dataset", arXiv:2309.11998, 2023):
per turn 94.46 +- 626.39 prompt tokens and 348.45 +- 269.93 response tokens. A lognormal with
mean m and standard deviation s has sigma^2 = ln(1 + s^2 / m^2) and mu = ln(m) - sigma^2 / 2:
prompts mu 2.645, sigma 1.951 (median ~14 tokens, a long tail), outputs mu 5.619, sigma
0.686 (median ~275). Both are clipped to [min, max] (the model's context and a run's length
budget): the clip shortens the tail, and the summary of what was sent is in the report.

**agent** -- multi-turn sessions whose requests share growing prefixes (prefix caching
matters there): every request starts with the same system/tool prefix (``system_len``
tokens), then the session's history (each earlier turn's user message and a reply of that
turn's output length), then the new user message. Files are written turn-major (turn 1 of
every session, then turn 2 ...), and the clients send them in file order, so a session's next
turn arrives after its earlier ones were sent (usually answered: not guaranteed under
overload, where the open loop does not wait; this is an approximation of a closed agent loop).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tailserve.bench.tokens import PromptSynth

# LMSYS-Chat-1M Table 1, the ShareGPT row (tokens per turn): mean, standard deviation.
SHAREGPT_PROMPT = (94.46, 626.39)
SHAREGPT_OUTPUT = (348.45, 269.93)


def lognormal_params(mean: float, std: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and standard deviation."""
    sigma2 = math.log(1.0 + (std / mean) ** 2)
    return math.log(mean) - sigma2 / 2.0, math.sqrt(sigma2)


@dataclass(frozen=True)
class ChatShape:
    prompt_min: int = 4
    prompt_max: int = 2048
    output_min: int = 4
    output_max: int = 512


def chat_lengths(n: int, seed: int, shape: ChatShape = ChatShape()) -> list[tuple[int, int]]:
    """``n`` (prompt tokens, output tokens) pairs, ShareGPT-like (module docstring)."""
    rng = np.random.default_rng([seed, 29])
    mu_p, s_p = lognormal_params(*SHAREGPT_PROMPT)
    mu_o, s_o = lognormal_params(*SHAREGPT_OUTPUT)
    p = np.clip(np.rint(rng.lognormal(mu_p, s_p, n)), shape.prompt_min, shape.prompt_max)
    o = np.clip(np.rint(rng.lognormal(mu_o, s_o, n)), shape.output_min, shape.output_max)
    return [(int(a), int(b)) for a, b in zip(p, o, strict=True)]


@dataclass(frozen=True)
class AgentShape:
    sessions: int = 8
    turns: int = 4
    system_len: int = 400  # the prefix every request shares (system prompt, tool schemas)
    user_median: int = 60  # a turn's new message: lognormal around this median
    user_sigma: float = 0.8
    user_max: int = 400
    output_len: int = 64  # each turn's reply (a tool call, a short answer)


@dataclass(frozen=True)
class AgentTurn:
    session: int
    turn: int  # 0-based
    user_lens: tuple[int, ...]  # this session's user messages so far, this turn's last
    output_len: int

    def prompt_len(self, shape: AgentShape) -> int:
        """Tokens of the prompt as the parts add up (the system prefix, every earlier turn's
        message and reply, this message); the text's own count can differ by a token or two
        where the parts join."""
        return shape.system_len + sum(self.user_lens) + self.turn * shape.output_len


def agent_sessions(seed: int, shape: AgentShape = AgentShape()) -> list[AgentTurn]:
    """Every turn of every session, turn-major (the order they are sent)."""
    rng = np.random.default_rng([seed, 30])
    users = np.clip(np.rint(rng.lognormal(math.log(shape.user_median), shape.user_sigma,
                                          (shape.sessions, shape.turns))), 1, shape.user_max)
    return [AgentTurn(s, t, tuple(int(x) for x in users[s, :t + 1]), shape.output_len)
            for t in range(shape.turns) for s in range(shape.sessions)]


def _synth(seed: int) -> PromptSynth:
    from tailserve.bench.tokens import LocalCounter, PromptSynth
    from tailserve.model.loader import load_tokenizer

    return PromptSynth(LocalCounter(load_tokenizer(None), "default"),
                       np.random.default_rng([seed, 31]))


def write_chat(n: int, seed: int, path: str, shape: ChatShape = ChatShape()) -> list[int]:
    """The chat workload's JSONL; returns the prompt lengths in the model's tokens."""
    synth = _synth(seed)
    lens = []
    with open(path, "w", encoding="utf-8") as f:
        for p, o in chat_lengths(n, seed, shape):
            text, count = synth.text(p)
            lens.append(count)
            f.write(json.dumps({"prompt": text, "max_tokens": o, "output_tokens": o}) + "\n")
    return lens


def write_agent(seed: int, path: str, shape: AgentShape = AgentShape()) -> list[int]:
    """The agent workload's JSONL (turn-major); returns the prompt lengths in tokens."""
    synth = _synth(seed)
    turns = agent_sessions(seed, shape)
    system, _ = synth.text(shape.system_len)
    # Each session's history as text, grown turn by turn: a later turn's prompt starts with
    # exactly the earlier turn's prompt and its reply (the shared, growing prefix).
    history = {s: system for s in range(shape.sessions)}
    lens = []
    tok = synth.counter
    with open(path, "w", encoding="utf-8") as f:
        for t in turns:
            user, _ = synth.text(t.user_lens[-1])
            prompt = f"{history[t.session]}\nUser: {user}\nAssistant:"
            reply, _ = synth.text(shape.output_len)
            history[t.session] = f"{prompt} {reply}"
            lens.append(tok.count(prompt))
            f.write(json.dumps({"prompt": prompt, "max_tokens": t.output_len,
                                "output_tokens": t.output_len}) + "\n")
    return lens
