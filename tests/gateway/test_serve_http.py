"""The HTTP server of ``agentgate serve`` against slow and greedy clients, over real sockets: a
request head or body that stalls is cut off (408) within its timeout, connections beyond
``--max-connections`` get 503, and ordinary requests (a body sent in pieces, keep-alive) are
unaffected; an idle keep-alive connection is closed after ``--keep-alive-timeout``."""

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.serve_proc import ServeProc, serve_proc

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 8.0  # NOTE: above uvicorn's own 5 s, so that the flag must have been applied
CUT_OFF_WITHIN_S = 10.0  # NOTE: generous on a noisy box; without the timeouts it never happens
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n")


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    args = ("--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
            "--keep-alive-timeout", str(KEEP_ALIVE_S))
    with serve_proc(sim_model_dir, tmp_path_factory.mktemp("http"), *args) as serve:
        yield serve


@pytest.mark.parametrize("sent", [b"", HEAD, b"GET /health HTTP/1.1\r\nHo"],
                         ids=["nothing", "half-head", "half-header-line"])
def test_stalled_request_head_is_cut_off(gateway: ServeProc, sent: bytes) -> None:
    with _connect(gateway) as sock:
        sock.sendall(sent)
        reply, waited_s = _read_until_closed(sock)
    assert waited_s < CUT_OFF_WITHIN_S, f"closed after {waited_s:.1f} s"
    assert waited_s >= HEADER_TIMEOUT_S * 0.9, f"closed too early: {waited_s:.1f} s"
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply


def test_trickled_request_head_is_cut_off(gateway: ServeProc) -> None:
    """The head timeout is for the whole head, not between bytes."""
    with _connect(gateway) as sock:
        start = time.monotonic()
        closed = False
        for byte in HEAD * 4:  # NOTE: bounded: 4 heads' worth of bytes, one every 0.1 s
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - start > CUT_OFF_WITHIN_S:
                break
        if not closed:
            reply, _ = _read_until_closed(sock)
            closed = reply == b"" or reply.startswith(b"HTTP/1.1 408")
    assert closed, "a head trickled byte by byte was never cut off"


def test_stalled_body_is_cut_off(gateway: ServeProc) -> None:
    with _connect(gateway) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"model": "m"')
        reply, waited_s = _read_until_closed(sock)
    assert BODY_TIMEOUT_S * 0.9 <= waited_s < CUT_OFF_WITHIN_S, f"closed after {waited_s:.1f} s"
    assert reply.startswith(b"HTTP/1.1 408"), reply


def test_body_in_slow_pieces_and_keep_alive_are_unaffected(gateway: ServeProc) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    with _connect(gateway) as sock:
        for _ in range(2):  # NOTE: the second request reuses the connection
            sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), len(body) // 3 + 1):
                time.sleep(BODY_TIMEOUT_S / 3)  # NOTE: each gap below the body timeout
                sock.sendall(body[i:i + len(body) // 3 + 1])
            reply = _read_response(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply
            assert b'"completion_tokens":2' in reply, reply
        time.sleep(HEADER_TIMEOUT_S + 0.5)  # NOTE: idle between requests is keep-alive's
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def test_idle_keep_alive_connection_is_closed_after_keep_alive_timeout(gateway: ServeProc) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        reply, waited_s = _read_until_closed(sock)
    assert reply == b"", reply
    assert KEEP_ALIVE_S * 0.9 <= waited_s < KEEP_ALIVE_S + CUT_OFF_WITHIN_S, (
        f"an idle keep-alive connection closed after {waited_s:.1f} s, not {KEEP_ALIVE_S} s")


def test_connections_beyond_the_cap_get_503(sim_model_dir: Path, tmp_path: Path) -> None:
    with serve_proc(sim_model_dir, tmp_path, "--max-connections", "3") as serve:
        held = [_connect(serve) for _ in range(3)]
        try:
            time.sleep(0.5)  # NOTE: let the server accept them
            with _connect(serve) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_response(sock).startswith(b"HTTP/1.1 503")
            held.pop().close()
            time.sleep(0.5)
            with _connect(serve) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_response(sock).startswith(b"HTTP/1.1 200")
        finally:
            for sock in held:
                sock.close()


def _connect(serve: ServeProc) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", serve.port), timeout=5)
    sock.settimeout(CUT_OFF_WITHIN_S + 5)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; fails if it keeps the connection open."""
    start = time.monotonic()
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pytest.fail(f"the connection was still open after {time.monotonic() - start:.1f} s")
    except ConnectionResetError:
        pass
    return b"".join(chunks), time.monotonic() - start


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body
