"""Agent sessions against ``agentgate serve`` under Locust (issue 11). Four kinds of simulated
agents run multi-turn conversations with one function tool, their steps separated by
heavy-tailed think times, a fraction of the conversations starting from a long (8-30 KB)
document (the workload: ``locust_workload.py``):

- ``rest``: Sessions API turns, non-streamed (``POST /v1/sessions/{id}/turns``);
- ``sse``: the same with ``"stream": true`` (``turn_start`` / ``delta`` / ``turn_end`` events);
- ``ws``: the same over the session WebSocket (``turn`` frames on ``/v1/sessions/{id}/ws``);
- ``chat``: a stateless OpenAI client, ``POST /v1/chat/completions`` streamed, resending the
  whole history (tools included) every step.

A step after a user message requires a tool call (``tool_choice: "required"``) with
``--tool-fraction``; whenever an answer carries tool calls (forced, or drawn by chance from the
sim's random tokens) the next step sends their results, else a new user message.

Stats entries (Locust's console, CSV and HTML), by request type and name:

- ``TURN <kind>``: one per turn, its stream read to the end; its "content size" is the turn's
  completion tokens, not bytes (``locust_report.py`` turns it into tok/s);
- ``TTFT <kind>``: turn sent to its first content delta; ``ITL <kind>``: the gap between two
  consecutive content deltas (a delta may carry several tokens); for the streamed kinds;
- ``POST /v1/sessions``, ``DELETE /v1/sessions/{id}``, ``WS connect``, ``GET /v1/models``.

A failed turn is a failure of ``TURN <kind>`` named by what went wrong: ``HTTP 429
rate_limit_exceeded``, ``SSE error event server_error``, ``WS error frame turn_in_progress``,
``WS closed``, ``WS handshake 401``, ``client ConnectionError (RemoteDisconnected)``, ``no
turn_end``; other requests' failures are named the same way under their own entries.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 20 -r 5 -t 60s \
        --stop-timeout 30      # users finish the turn they are in (see AgentUser)
    loadtest/locust.sh          # the same against a sim gateway it starts, then a summary

The workload options (think times, steps, sizes, tool and long-context shares, seed) are flags,
or the environment variables they name: ``locust_workload.add_arguments``. ``AGENTGATE_API_KEY``
is sent as ``Authorization: Bearer``, for a gateway started with ``--api-keys``.
"""

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import requests
import websocket  # websocket-client: installed with locust (python-socketio[client])
from locust import User, events, task
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC
from locust_workload import (
    TOOL,
    LoadConfig,
    Reply,
    RequestFailure,
    StreamClock,
    Workload,
    add_arguments,
    error_code,
    read_chat_chunks,
    read_turn_events,
    reply_of,
    sse_data,
)
from requests.adapters import HTTPAdapter
from urllib3.util import Retry

StreamReader = Callable[[Iterator[dict[str, Any]], StreamClock], tuple[Reply, int]]
events.init_command_line_parser.add_listener(add_arguments)
_user_ids = itertools.count()


@events.test_stop.add_listener
def let_csv_catch_up(environment: Environment, **_: Any) -> None:
    """NOTE: Locust writes its CSV files every CSV_STATS_INTERVAL_SEC and not again at exit, so
    the turns users finished during ``--stop-timeout`` would be missing from them; one more
    interval after the users stopped lets the writer's last pass see every turn."""
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.25)


class AgentUser(User):
    """One simulated agent. Each task is one conversation of ``steps_min..steps_max`` turns with
    a think time (``wait_time``) before every turn after the first; subclasses say how a
    conversation opens, how a turn runs and how a conversation ends.

    NOTE: the think time is ``self.wait()``, so at the end of a run (``--stop-timeout``) a user
    finishes the turn it is in and stops at its next think: the stop cuts no stream.
    """

    abstract = True
    kind = ""

    def wait_time(self) -> float:
        return self.workload.think_time_s()

    def on_start(self) -> None:
        self.cfg = LoadConfig.from_options(self.environment.parsed_options)
        self.workload = Workload(self.cfg, next(_user_ids))
        self.base_url = (self.host or "").rstrip("/")
        self.http = requests.Session()
        self.http.headers.update(self.cfg.headers)
        # NOTE: a pooled connection idle for about the server's keep-alive timeout (uvicorn: 5 s)
        # may be closed just as a request goes out on it (ConnectionError, RemoteDisconnected).
        # HTTP clients retry idempotent requests on that race (RFC 9112 9.3.1), so GET and
        # DELETE are retried once; turns and creates are not (a real failure must show).
        retry = Retry(total=1, connect=1, read=1, status=0, other=0,
                      allowed_methods=frozenset({"GET", "DELETE"}), raise_on_status=False)
        self.http.mount("http://", HTTPAdapter(max_retries=retry))

    def on_stop(self) -> None:
        self.http.close()

    @task
    def conversation(self) -> None:
        if not self.open(self.workload.history()):
            return
        pending = [self.workload.user_message()]
        for step in range(self.workload.num_steps()):
            if step:
                self.wait()
            reply = self.turn(pending, self.workload.sampling(pending))
            if reply is None:
                break
            pending = self.workload.next_messages(reply)
        self.close()

    def open(self, history: list[dict[str, Any]]) -> bool:
        """Start a conversation from ``history`` (prior messages); False if that failed."""
        raise NotImplementedError

    def turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply | None:
        """Send ``messages``, read the answer, record the turn; None if it failed."""
        raise NotImplementedError

    def close(self) -> None:
        """End the conversation after its last turn."""

    def call(self, method: str, path: str, name: str, body: Any = None) -> Any:
        """One plain JSON request, recorded as ``method name``; its JSON, None if it failed."""
        start = time.perf_counter()
        try:
            resp = self.http.request(method, self.base_url + path, json=body,
                                     timeout=self.cfg.timeout)
            data = resp.json() if resp.ok else _json_or_none(resp)
        except requests.RequestException as exc:
            self.record(method, name, start, _client_error(exc))
            return None
        error = None if resp.ok else _http_error(resp.status_code, data)
        self.record(method, name, start, error, len(resp.content))
        return data if error is None else None

    def stream(self, path: str, body: dict[str, Any], read: StreamReader) -> Reply | None:
        """One streamed (SSE) turn: POST ``body``, ``read`` its events, record the turn."""
        start = time.perf_counter()
        clock = StreamClock(start)
        try:
            with self.http.post(self.base_url + path, json=body, stream=True,
                                timeout=self.cfg.timeout) as resp:
                if resp.status_code != 200:
                    error = _http_error(resp.status_code, _json_or_none(resp))
                    self.record_turn(start, clock, error)
                    return None
                reply, num_tokens = read(sse_data(resp.iter_content(chunk_size=None)), clock)
        except (requests.RequestException, ValueError) as exc:
            self.record_turn(start, clock, _client_error(exc))
            return None
        except RequestFailure as exc:
            self.record_turn(start, clock, str(exc))
            return None
        self.record_turn(start, clock, None, num_tokens)
        return reply

    def record(self, request_type: str, name: str, start: float, error: str | None = None,
               length: int = 0) -> None:
        """One Locust request entry from ``start`` (``time.perf_counter()``) to now."""
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=(time.perf_counter() - start)
            * 1000, response_length=length, exception=RequestFailure(error) if error else None,
            context={})

    def record_turn(self, start: float, clock: StreamClock | None, error: str | None = None,
                    num_tokens: int = 0) -> None:
        """``TURN kind``, then ``TTFT kind`` and ``ITL kind`` if content streamed (also for a
        turn that failed after its first delta: what it measured is still true)."""
        self.record("TURN", self.kind, start, error, num_tokens)
        if clock is None or clock.ttft_ms is None:
            return
        fire = self.environment.events.request.fire
        fire(request_type="TTFT", name=self.kind, response_time=clock.ttft_ms,
             response_length=0, exception=None, context={})
        for gap_ms in clock.itl_ms:
            fire(request_type="ITL", name=self.kind, response_time=gap_ms, response_length=0,
                 exception=None, context={})


class SessionUser(AgentUser):
    """A Sessions API agent: the gateway keeps the conversation, each turn sends what is new."""

    abstract = True

    def open(self, history: list[dict[str, Any]]) -> bool:
        body = {"system": self.workload.system, "tools": [TOOL], "messages": history,
                "metadata": {"client": f"locust-{self.kind}"}}
        created = self.call("POST", "/v1/sessions", "/v1/sessions", body)
        self.session_id = created["id"] if created else ""
        return bool(self.session_id)

    def close(self) -> None:
        self.call("DELETE", f"/v1/sessions/{self.session_id}", "/v1/sessions/{id}")

    @property
    def turns_path(self) -> str:
        return f"/v1/sessions/{self.session_id}/turns"


class RestSessionUser(SessionUser):
    kind = "rest"

    def turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply | None:
        start = time.perf_counter()
        try:
            resp = self.http.post(self.base_url + self.turns_path,
                                  json={"messages": messages, **sampling}, timeout=self.cfg.timeout)
            data = _json_or_none(resp)
        except requests.RequestException as exc:
            self.record_turn(start, None, _client_error(exc))
            return None
        if resp.status_code != 200 or data is None:
            self.record_turn(start, None, _http_error(resp.status_code, data))
            return None
        self.record_turn(start, None, None, data["usage"]["completion_tokens"])
        return reply_of(data["message"])


class SseSessionUser(SessionUser):
    kind = "sse"

    def turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply | None:
        body = {"messages": messages, "stream": True, **sampling}
        return self.stream(self.turns_path, body, read_turn_events)


class WsSessionUser(SessionUser):
    """Turns over one WebSocket per conversation (opened after the session is created)."""

    kind = "ws"
    ws: websocket.WebSocket | None = None

    def open(self, history: list[dict[str, Any]]) -> bool:
        if not super().open(history):
            return False
        start = time.perf_counter()
        url = self.base_url.replace("http", "ws", 1) + f"/v1/sessions/{self.session_id}/ws"
        try:
            self.ws = websocket.create_connection(
                url, header=[f"{k}: {v}" for k, v in self.cfg.headers.items()],
                timeout=self.cfg.request_timeout_s)
        except (websocket.WebSocketException, OSError) as exc:
            self.record("WS", "connect", start, _ws_error(exc))
            super().close()
            return False
        self.record("WS", "connect", start)
        return True

    def turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply | None:
        assert self.ws is not None
        start = time.perf_counter()
        clock = StreamClock(start)
        try:
            self.ws.send(json.dumps({"type": "turn", "messages": messages, **sampling}))
            reply, num_tokens = read_turn_events(self._frames(), clock, "WS error frame")
        except (websocket.WebSocketException, OSError, ValueError) as exc:
            self.record_turn(start, clock, _ws_error(exc))
            return None
        except RequestFailure as exc:
            self.record_turn(start, clock, str(exc))
            return None
        self.record_turn(start, clock, None, num_tokens)
        return reply

    def close(self) -> None:
        self._close_ws()
        super().close()

    def on_stop(self) -> None:
        self._close_ws()
        super().on_stop()

    def _frames(self) -> Iterator[dict[str, Any]]:
        assert self.ws is not None
        while True:  # NOTE: bounded by the reader (MAX_EVENTS) and the recv timeout
            text = self.ws.recv()
            if not text:  # NOTE: websocket-client answers a close frame with "" (no exception)
                raise websocket.WebSocketConnectionClosedException("closed by the gateway")
            yield json.loads(text)

    def _close_ws(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            ws.close(timeout=1)


class ChatUser(AgentUser):
    """A stateless OpenAI client (as agent frameworks are): the whole history every turn."""

    kind = "chat"

    def on_start(self) -> None:
        super().on_start()
        models = self.call("GET", "/v1/models", "/v1/models")
        # NOTE: a gateway that listed no model gets none: each turn's 4xx then says so
        self.model = models["data"][0]["id"] if models and models.get("data") else None
        self.messages: list[dict[str, Any]] = []

    def open(self, history: list[dict[str, Any]]) -> bool:
        self.messages = [{"role": "system", "content": self.workload.system}, *history]
        return True

    def turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply | None:
        self.messages.extend(messages)
        body = {"model": self.model, "messages": self.messages, "tools": [TOOL], "stream": True,
                "stream_options": {"include_usage": True}, **sampling}
        reply = self.stream("/v1/chat/completions", body, read_chat_chunks)
        if reply is not None:
            self.messages.append(_assistant_message(reply))
        return reply


def _assistant_message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    elif reply.content is None:
        message["content"] = ""
    return message


def _json_or_none(resp: requests.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _http_error(status: int, body: Any) -> str:
    return f"HTTP {status} {error_code(body)}".rstrip()


def _client_error(exc: BaseException) -> str:
    """``client <exception>``, with the innermost cause in parentheses (``requests`` wraps
    urllib3's, which wraps the socket's: ``ConnectionError (RemoteDisconnected)``)."""
    cause = exc
    for _ in range(8):  # NOTE: bounded; exceptions hold their cause in args or in .reason
        inner = getattr(cause, "reason", None)
        if not isinstance(inner, BaseException):
            inner = next((a for a in cause.args if isinstance(a, BaseException)), None)
        if inner is None:
            break
        cause = inner
    name = type(exc).__name__
    return f"client {name}" if cause is exc else f"client {name} ({type(cause).__name__})"


def _ws_error(exc: BaseException) -> str:
    if isinstance(exc, websocket.WebSocketBadStatusException):
        return f"WS handshake {exc.status_code}"
    if isinstance(exc, websocket.WebSocketTimeoutException):
        return "WS timeout"
    if isinstance(exc, websocket.WebSocketConnectionClosedException):
        return "WS closed"
    return _client_error(exc)
