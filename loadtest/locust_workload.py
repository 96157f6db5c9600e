"""What the Locust agents (``locustfile.py``) send and how they read it, without Locust: the
workload options and their config, think times, the text of prompts and tool results, and the
parsing and timing of a streamed answer. Kept apart so that it reads (and is tested) on its own.

Think times are heavy-tailed: most agent steps follow quickly, a few wait long (a slow tool, a
human), as in real agent traffic. Conversations share one system prompt (one agent's
instructions, so the prefix cache has something to hit) and differ from their first user
message on; a ``long_fraction`` of them start from a long pasted document (8-30 KB).
"""

import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

# --- parameters (defaults of the options) --------------------------------------------------
THINK_DIST, THINK_SCALE_S, THINK_SHAPE, THINK_MAX_S = "pareto", 0.25, 1.5, 10.0
STEPS_MIN, STEPS_MAX, MAX_TOKENS, TOOL_MAX_TOKENS = 2, 8, 48, 96
TOOL_FRACTION, LONG_FRACTION, LONG_MIN_KB, LONG_MAX_KB = 0.3, 0.15, 8, 30
REQUEST_TIMEOUT_S, CONNECT_TIMEOUT_S, SEED = 120.0, 10.0, 0
MAX_EVENTS = 100_000  # NOTE: bound of one turn's events or frames, far above any max_tokens
SYSTEM_CHARS, USER_CHARS, TOOL_RESULT_CHARS = 1500, (80, 600), (200, 2000)
TOOL = {"type": "function", "function": {
    "name": "find",
    "description": "Find the passages of the project's documents that mention a word.",
    # NOTE: a short bounded string, so that a forced call fits TOOL_MAX_TOKENS even with the
    # demo tokenizer (about a token a character): ~60 tokens with the call markers
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}},
                   "required": ["q"], "additionalProperties": False},
}}
WORDS = ["agent", "gateway", "session", "token", "cache", "worker", "prefix", "window", "stream",
         "route", "admit", "tenant", "latency", "budget", "replay", "page", "model", "tool",
         "call", "result", "answer", "question", "plan", "step", "check", "file", "line",
         "error", "retry", "queue", "batch", "decode", "prefill", "context", "history"]
_THINK_DRAWS: dict[str, Callable[[random.Random, float, float], float]] = {
    "pareto": lambda rng, scale, shape: scale * rng.paretovariate(shape),  # scale: the minimum
    "lognormal": lambda rng, scale, shape: scale * math.exp(shape * rng.gauss(0.0, 1.0)),
}


def add_arguments(parser: Any) -> None:
    """The workload options on Locust's parser (configargparse): each is a flag and an
    environment variable (``env_var``); ``LoadConfig.from_options`` reads them back."""
    arg = parser.add_argument  # NOTE: not a group: only Locust's own add_argument takes is_secret
    arg("--api-key", env_var="AGENTGATE_API_KEY", default="", is_secret=True,
        help="sent as Authorization: Bearer (prefer the environment variable to the flag)")
    arg("--think-dist", env_var="LOCUST_THINK_DIST", choices=sorted(_THINK_DRAWS),
        default=THINK_DIST, help="distribution of the think time before an agent step")
    arg("--think-scale-s", env_var="LOCUST_THINK_SCALE_S", type=float, default=THINK_SCALE_S,
        help="pareto: the shortest think; lognormal: the median (seconds)")
    arg("--think-shape", env_var="LOCUST_THINK_SHAPE", type=float, default=THINK_SHAPE,
        help="pareto: alpha (smaller: heavier tail); lognormal: sigma")
    arg("--think-max-s", env_var="LOCUST_THINK_MAX_S", type=float, default=THINK_MAX_S,
        help="cap of one think time (seconds)")
    arg("--steps-min", env_var="LOCUST_STEPS_MIN", type=int, default=STEPS_MIN,
        help="fewest agent steps (turns) in a conversation")
    arg("--steps-max", env_var="LOCUST_STEPS_MAX", type=int, default=STEPS_MAX,
        help="most agent steps (turns) in a conversation")
    arg("--max-tokens", env_var="LOCUST_MAX_TOKENS", type=int, default=MAX_TOKENS,
        help=f"max_tokens of a step ({TOOL_MAX_TOKENS} when it requires a tool call)")
    arg("--tool-fraction", env_var="LOCUST_TOOL_FRACTION", type=float, default=TOOL_FRACTION,
        help="share of the steps after a user message that require a tool call")
    arg("--long-fraction", env_var="LOCUST_LONG_FRACTION", type=float, default=LONG_FRACTION,
        help="share of conversations that start from a long pasted document")
    arg("--long-min-kb", env_var="LOCUST_LONG_MIN_KB", type=int, default=LONG_MIN_KB,
        help="size of the shortest such document (KB)")
    arg("--long-max-kb", env_var="LOCUST_LONG_MAX_KB", type=int, default=LONG_MAX_KB,
        help="size of the longest such document (KB)")
    arg("--request-timeout-s", env_var="LOCUST_REQUEST_TIMEOUT_S", type=float,
        default=REQUEST_TIMEOUT_S, help="read timeout of a response, a stream's next event or "
        "a WebSocket frame (seconds)")
    arg("--seed", env_var="LOCUST_SEED", type=int, default=SEED,
        help="seed of the text and the think times (user i draws from seed and i)")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    api_key: str
    think_dist: str
    think_scale_s: float
    think_shape: float
    think_max_s: float
    steps_min: int
    steps_max: int
    max_tokens: int
    tool_fraction: float
    long_fraction: float
    long_min_kb: int
    long_max_kb: int
    request_timeout_s: float
    seed: int

    def __post_init__(self) -> None:
        assert self.think_dist in _THINK_DRAWS, f"think_dist={self.think_dist}"
        assert min(self.think_scale_s, self.think_shape, self.think_max_s) > 0, self
        assert 1 <= self.steps_min <= self.steps_max, f"steps {self.steps_min}..{self.steps_max}"
        assert self.max_tokens >= 1 and self.request_timeout_s > 0, self
        assert 0 <= self.tool_fraction <= 1 and 0 <= self.long_fraction <= 1, self
        assert 0 < self.long_min_kb <= self.long_max_kb, f"{self.long_min_kb}..{self.long_max_kb}"

    @classmethod
    def from_options(cls, options: Any) -> "LoadConfig":
        """From Locust's ``environment.parsed_options`` (``add_arguments``)."""
        return cls(**{name: getattr(options, name) for name in cls.__slots__})

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def timeout(self) -> tuple[float, float]:
        """``requests``' (connect, read) timeout."""
        return CONNECT_TIMEOUT_S, self.request_timeout_s


class Reply(NamedTuple):
    content: str | None
    tool_calls: list[dict[str, Any]]


class RequestFailure(Exception):
    """A failed request or turn. Its text names the failure in Locust's stats (failures are
    grouped by it), so it holds no ids."""


class Workload:
    """One user's draws: its think times and the messages of its conversations."""

    def __init__(self, cfg: LoadConfig, user_id: int) -> None:
        self.cfg = cfg
        self.user_id = user_id
        self.rng = random.Random(cfg.seed * 1_000_003 + user_id)
        self.system = filler(random.Random(cfg.seed), SYSTEM_CHARS)  # NOTE: the same for all
        self.num_conversations = 0

    def think_time_s(self) -> float:
        return think_time_s(self.rng, self.cfg)

    def num_steps(self) -> int:
        return self.rng.randint(self.cfg.steps_min, self.cfg.steps_max)

    def history(self) -> list[dict[str, Any]]:
        """A new conversation's prior messages: none, or (``long_fraction``) a long document."""
        self.num_conversations += 1
        if self.rng.random() >= self.cfg.long_fraction:
            return []
        document = filler(self.rng, int(1024 * self.rng.uniform(self.cfg.long_min_kb,
                                                                 self.cfg.long_max_kb)))
        return [{"role": "user", "content": f"Here is the file to work on:\n{document}"},
                {"role": "assistant", "content": "I have read the file."}]

    def user_message(self) -> dict[str, Any]:
        # NOTE: a unique first line, so that conversations share only the system prompt
        tag = f"[user {self.user_id}, conversation {self.num_conversations}]"
        text = filler(self.rng, _draw(self.rng, USER_CHARS))
        return {"role": "user", "content": f"{tag}\n{text}"}

    def sampling(self, pending: list[dict[str, Any]]) -> dict[str, Any]:
        """The step's sampling fields: after a user message, a forced tool call with
        ``tool_fraction``; else ``max_tokens`` only (``tool_choice`` stays ``auto``)."""
        if pending[0]["role"] == "user" and self.rng.random() < self.cfg.tool_fraction:
            return {"max_tokens": TOOL_MAX_TOKENS, "tool_choice": "required",
                    "parallel_tool_calls": False}
        return {"max_tokens": self.cfg.max_tokens}

    def next_messages(self, reply: Reply) -> list[dict[str, Any]]:
        """What the agent sends next: a result for each tool call, else a new user message."""
        if not reply.tool_calls:
            return [self.user_message()]
        return [{"role": "tool", "tool_call_id": call["id"],
                 "content": filler(self.rng, _draw(self.rng, TOOL_RESULT_CHARS))}
                for call in reply.tool_calls]


class StreamClock:
    """When each content delta of one streamed turn arrived: TTFT from ``start``, then the
    gaps between deltas (ITL). ``start`` and the ticks are ``time.perf_counter()``."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    @property
    def ttft_ms(self) -> float | None:
        return (self.times[0] - self.start) * 1000 if self.times else None

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in itertools.pairwise(self.times)]


def read_turn_events(
    frames: Iterator[dict[str, Any]], clock: StreamClock, error_name: str = "SSE error event"
) -> tuple[Reply, int]:
    """A session turn's SSE events or WebSocket frames up to ``turn_end``: its reply and
    completion tokens; each content ``delta`` ticks ``clock``.

    Raises:
        RequestFailure: an ``error`` event or frame (``error_name`` and its code), or no
            ``turn_end``.
    """
    for frame in itertools.islice(frames, MAX_EVENTS):
        kind = frame.get("type")
        if kind == "delta" and frame.get("content"):
            clock.tick()
        elif kind == "turn_end":
            return reply_of(frame["message"]), frame["usage"]["completion_tokens"]
        elif kind == "error" or "error" in frame:
            raise RequestFailure(f"{error_name} {error_code(frame)}".rstrip())
    raise RequestFailure("no turn_end")


def read_chat_chunks(chunks: Iterator[dict[str, Any]], clock: StreamClock) -> tuple[Reply, int]:
    """A streamed chat completion's chunks up to ``[DONE]``: the reply (tool call deltas
    joined) and its completion tokens (``include_usage``); each content delta ticks ``clock``.

    Raises:
        RequestFailure: an ``error`` event, or no ``finish_reason``.
    """
    content, calls, num_tokens, finished = [], {}, 0, False
    for chunk in itertools.islice(chunks, MAX_EVENTS):
        if "error" in chunk:
            raise RequestFailure(f"SSE error event {error_code(chunk)}".rstrip())
        num_tokens = (chunk.get("usage") or {}).get("completion_tokens", num_tokens)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                clock.tick()
                content.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                _merge_call_delta(calls, call)
            finished = finished or bool(choice.get("finish_reason"))
    if not finished:
        raise RequestFailure("no finish_reason")
    return Reply("".join(content) or None, [calls[i] for i in sorted(calls)]), num_tokens


def reply_of(message: dict[str, Any]) -> Reply:
    """The ``Reply`` in an assistant message (a session turn's ``message``)."""
    return Reply(message.get("content"), message.get("tool_calls") or [])


def think_time_s(rng: random.Random, cfg: LoadConfig) -> float:
    """One think time drawn from ``cfg.think_dist``, capped at ``cfg.think_max_s``."""
    draw = _THINK_DRAWS[cfg.think_dist](rng, cfg.think_scale_s, cfg.think_shape)
    return min(draw, cfg.think_max_s)


def filler(rng: random.Random, num_chars: int) -> str:
    """Words, about ``num_chars`` characters of them (at least one word)."""
    words, size = [], 0
    while size < num_chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def sse_data(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE body's ``data:`` lines as its chunks arrive, up to ``data:
    [DONE]`` or the end of the body; other lines (``event:``, comments, blanks) are skipped.

    Raises:
        ValueError: a ``data:`` line that is not JSON.
    """
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


def error_code(body: Any) -> str:
    """The ``code`` (else ``type``) of an OpenAI-style ``{"error": {...}}`` body, or ""."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ""
    return str(error.get("code") or error.get("type") or "")


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def _merge_call_delta(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    call = calls.setdefault(delta.get("index", 0), {
        "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"]
    function = delta.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""
