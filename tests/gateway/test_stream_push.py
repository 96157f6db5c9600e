"""Plain content streams skip the stream's layers (``RequestStream.push``, ``sse.EventStream``,
the server's ``BodyWriter``): on a real ``agentgate serve``, a streamed chat completion with no
stop strings, tools or logprobs is written from the worker's replies, and says exactly what the
queued way says. The queued way is forced here by a stop string that never matches (the same
tokens, and the same text, with the stop matcher in the path)."""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.serve_proc import ServeProc, serve_proc

NEVER = "\x07never\x07"
PUSHED = re.compile(r"^agentgate_stream_pushed_tokens_total (\S+)$", re.M)


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    # NOTE: a paced worker (the default "cpu" cost): the stream's reader waits between steps
    with serve_proc(sim_model_dir, tmp_path_factory.mktemp("push")) as serve:
        yield serve


def _stream(http: httpx.Client, content: str, **extra: object) -> list[dict]:
    body = {"model": "m", "stream": True, "max_tokens": 24, "seed": 7,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}], **extra}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _pushed(http: httpx.Client) -> float:
    match = PUSHED.search(http.get("/metrics").text)
    assert match, "the pushed-tokens counter is exported"
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
