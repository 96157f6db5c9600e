"""Streams skip the stream's layers (``RequestStream.push``, ``sse.EventStream``, the server's
``BodyWriter``): on a real ``agentgate serve``, a streamed chat completion with no stop strings
or logprobs, tool calls included, is written from the worker's replies, and says exactly what
the queued way says. The queued way is forced here by a stop string that never matches (the
same tokens, and the same text, with the stop matcher in the path)."""

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.protocol import TokenDelta
from gateway import sse
from gateway.controllers.openai import _delta_push, _Head
from gateway.lifespan import ModelState
from gateway.tokenizer import StreamDecoder
from tests.gateway.serve_proc import ServeProc, serve_proc

NEVER = "\x07never\x07"
PUSHED = re.compile(r"^agentgate_stream_pushed_tokens_total (\S+)$", re.M)
PAUSED = re.compile(r"^agentgate_retention_paused_conversations (\S+)$", re.M)


@pytest.fixture(scope="module")
def fast(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    """A worker that steps as fast as it can: a client that stops reading fills every buffer."""
    with serve_proc(sim_model_dir, tmp_path_factory.mktemp("push-fast"), "--cost", "zero") as s:
        yield s


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    # NOTE: a paced worker (the default "cpu" cost): the stream's reader waits between steps
    with serve_proc(sim_model_dir, tmp_path_factory.mktemp("push")) as serve:
        yield serve


def _stream(http: httpx.Client, content: str, **extra: object) -> list[dict]:
    body = {"model": "m", "stream": True, "max_tokens": 24, "seed": 7,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}]} | extra
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _pushed(http: httpx.Client) -> float:
    return _metric(http, PUSHED)


def _metric(http: httpx.Client, pattern: re.Pattern[str]) -> float:
    match = pattern.search(http.get("/metrics").text)
    assert match, f"{pattern.pattern} is exported"
    return float(match[1])


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("content", ["Tell a story.", "Count to ten, slowly.", "ümlaut → ✓"])
def test_a_pushed_stream_says_what_the_queued_way_says(gateway: ServeProc, content: str) -> None:
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        before = _pushed(http)
        pushed = _stream(http, content)
        between = _pushed(http)
        queued = _stream(http, content, stop=[NEVER])
        after = _pushed(http)
    assert between > before, "a plain stream's tokens were pushed"
    assert after == between, "a stream with stop strings takes the queued way"
    assert _text(pushed) == _text(queued) and _text(pushed)
    assert pushed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _ends(pushed) == _ends(queued)
    ids = {c["id"] for c in pushed}
    assert len(ids) == 1, "every chunk, pushed or not, carries the stream's id"
    keys = {tuple(sorted(c)) for c in pushed}
    assert keys == {tuple(sorted(c)) for c in queued}, "the same chunk fields both ways"


def _ends(chunks: list[dict]) -> list[tuple[object, object]]:
    """(finish reason, usage less the cache hit: the second request hits) of the last two."""
    return [(c["choices"][0]["finish_reason"] if c["choices"] else None,
             {k: v for k, v in (c.get("usage") or {}).items() if k != "prompt_tokens_details"})
            for c in chunks[-2:]]


def test_a_client_that_stops_reading_gets_every_token_in_order(fast: ServeProc) -> None:
    """A client that reads nothing for 2 s while ~150 KB of chunks is written, then everything:
    the text is still exactly the queued way's. (The kernel's socket buffers on loopback take
    it all, so uvicorn's transport never pauses here; a paused transport declining a push is
    ``test_a_push_is_declined_untouched_while_the_writer_is_not_ready``.)"""
    body = {"model": "m", "stream": True, "max_tokens": LONG, "seed": 11,
            "messages": [{"role": "user", "content": "A long one, please."}]}
    with httpx.Client(base_url=fast.base_url, timeout=120) as http:
        queued = _text(_stream(http, "A long one, please.", max_tokens=LONG, seed=11,
                               stop=[NEVER]))
        before = _pushed(http)
        raw = _read_slowly(fast.port, json.dumps(body).encode())
        pushed = _pushed(http) - before
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = _text([json.loads(e) for e in events[:-1]])
    assert text == queued and len(text) > 200
    assert pushed > 0, "the slow client's stream was pushed"


# NOTE: below the 1024 unread deltas a stream may hold (WorkerClient.max_pending_deltas): a
# reader that falls behind a worker this fast on a loaded box is cut off by design
LONG = 1000


def _read_slowly(port: int, body: bytes) -> bytes:
    """POST ``body`` on a socket with a small receive buffer, read nothing for a while (the
    gateway's writes pause), then read to the end; the de-chunked body."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        time.sleep(2.0)  # NOTE: a few hundred KB of chunks wait: the kernel's buffers are full
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # NOTE: bounded by the socket's timeout
            piece = sock.recv(65536)
            assert piece, "the gateway closed the stream early"
            data += piece
    head, _, chunked = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    out, rest = b"", chunked
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            return out
        out, rest = out + rest[:size], rest[size + 2:]


class _Writer:
    """A ``BodyWriter`` whose readiness the test sets (a paused transport, then a drained one)."""

    def __init__(self) -> None:
        self.is_ready, self.written = False, []

    def ready(self) -> bool:
        return self.is_ready

    def write(self, body: bytes) -> None:
        self.written.append(body)


def test_a_push_is_declined_untouched_while_the_writer_is_not_ready(demo_model: ModelState) -> None:
    """Declined before decoding: the delta then takes the queued way, which must find the
    decoder as it was (a multi-byte character split across two deltas shows it)."""
    tokenizer = demo_model.tokenizer
    ids = tokenizer.encode("é✓!")
    assert len(ids) >= 3, ids
    decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
    fast, writer = sse.ContentChunks("chatcmpl-1", "m", 0), _Writer()
    push = _delta_push(_Head("chatcmpl-1", "m", 0), decoder, None, {}, fast, writer)
    first = TokenDelta(request_id="r", token_ids=ids[:1])
    assert not push(first) and writer.written == []
    assert decoder.feed_many(first.token_ids) == ""  # NOTE: the queued way: half a character
    writer.is_ready = True
    assert push(TokenDelta(request_id="r", token_ids=ids[1:]))
    assert writer.written == [fast.encode("é✓!")]


TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]


def test_a_pushed_tool_call_stream_says_what_the_queued_way_says(gateway: ServeProc) -> None:
    """``tool_choice: required``: the worker's grammar makes it call the tool, so the stream's
    text goes through the tool-call parser on the push too; the calls, the finish reason and
    the tool pause (the answer's call noted, so its conversation is held for the tool's
    result) agree."""
    extra = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 1000, "seed": 5}
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        before, paused0 = _pushed(http), _metric(http, PAUSED)
        pushed = _stream(http, "Look up wallaby.", **extra)
        between, paused1 = _pushed(http), _metric(http, PAUSED)
        queued = _stream(http, "Look up wallaby.", stop=[NEVER], **extra)
        paused2 = _metric(http, PAUSED)
    assert between > before, "a tool-call stream's tokens were pushed"
    assert paused1 == paused0 + 1 and paused2 == paused1 + 1, (paused0, paused1, paused2)
    assert _calls(pushed) == _calls(queued) and _calls(pushed), _calls(pushed)
    assert _ends(pushed) == _ends(queued) and _ends(pushed)[0][0] == "tool_calls"
    assert _text(pushed) == _text(queued)


def _calls(chunks: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call (ids differ between the two requests)."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for call in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    return [(name, args) for _, (name, args) in sorted(calls.items())]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["content", "tool-call"])
def test_a_pushed_session_turn_streams_and_records_what_the_queued_way_does(
        gateway: ServeProc, tools: list[dict] | None) -> None:
    """Sessions API turns (``POST /v1/sessions/{id}/turns``, streamed): the frames, and the
    answer recorded in the session (its messages, the turn's usage), agree between a pushed
    turn and the same turn in another session forced the queued way."""
    turn = {"messages": [{"role": "user", "content": "Look up wallaby."}], "stream": True,
            "max_tokens": 1000 if tools else 40, "seed": 9}
    if tools:
        turn["tool_choice"] = "required"
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        before = _pushed(http)
        pushed = _session_turn(http, tools, turn)
        between = _pushed(http)
        queued = _session_turn(http, tools, turn | {"stop": [NEVER]})
        after = _pushed(http)
    assert between > before and after == between
    frames, session = pushed
    queued_frames, queued_session = queued
    kinds = [f["type"] for f in frames]
    assert kinds == [f["type"] for f in queued_frames] and kinds[-1] == "turn_end", kinds
    assert _frames_text(frames) == _frames_text(queued_frames)
    assert _recorded(session) == _recorded(queued_session)
    if tools:
        assert "tool_call" in kinds and frames[-1]["finish_reason"] == "tool_calls"


def _session_turn(http: httpx.Client, tools: list[dict] | None,
                  turn: dict) -> tuple[list[dict], dict]:
    """A new session, one streamed turn: (its SSE frames, the session afterwards)."""
    created = http.post("/v1/sessions", json={"system": "Be brief.", "tools": tools})
    assert created.status_code == 200, created.text
    sid = created.json()["id"]
    with http.stream("POST", f"/v1/sessions/{sid}/turns", json=turn) as r:
        assert r.status_code == 200, r.read()
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    session = http.get(f"/v1/sessions/{sid}").json()
    http.delete(f"/v1/sessions/{sid}")
    return frames, session


def _frames_text(frames: list[dict]) -> str:
    return "".join(f["content"] for f in frames if f["type"] == "delta")


def _recorded(session: dict) -> tuple[object, ...]:
    """The recorded answer and its token counts, call ids aside (each request draws its own)."""
    answer = dict(session["messages"][-1])
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in answer.pop("tool_calls", None) or []]
    usage = session["turns"][-1]["usage"]
    return answer, calls, usage["prompt_tokens"], usage["completion_tokens"]
