"""Replay inputs: Mooncake JSONL traces and the built-in agent-session workload.

Both give a list of ``TraceRequest``. A request is either open loop (``arrival_s`` fixed by the
trace) or closed loop (``parent`` set: it arrives ``think_s`` after its parent finished, so a slow
system sees its agents slow down, as real agents do).

Prompts are named by Mooncake-style block ids of ``block_size`` tokens: an equal id means an equal
block AND an equal prefix before it (ids are prefix-chained). A request with
``prefix_from_parent`` lists only its NEW blocks; its prompt is

    parent's prompt + parent's generated tokens + new blocks (the last one cut)

    |<- parent.input_length ->|<- parent.output_length ->|<-- new tokens -->|
    |      parent's prompt    |    parent's answer       | hash_ids (new)   |
    len(hash_ids) == ceil(new tokens / block_size)

so ``input_length`` (the whole prompt) = parent.input_length + parent.output_length + new tokens.
Without it, ``hash_ids`` name the whole prompt: ``len(hash_ids) == ceil(input_length /
block_size)``. In every list a parent comes before its children.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from replay.agent_params import TOOLS, AgentParams, LogNormal, ToolSpec

__all__ = ["AgentParams", "TOOLS", "ToolSpec", "TraceError", "TraceRequest", "agent_workload",
           "first_by_arrival", "load_mooncake", "new_tokens", "summary"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay (see the module docstring for the prompt's shape).

    ``arrival_s`` is None exactly when ``parent`` is set (closed loop). ``tool_names``: the tool
    calls this turn's answer ends in (empty unless ``ends_in_tool_call``); ``parent_tool_names``:
    the parent's (the pause this request follows was spent in those tools).
    """

    request_id: str
    session_id: str | None
    tenant: str
    arrival_s: float | None
    parent: str | None
    think_s: float
    prefix_from_parent: bool
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    parent_tool_names: tuple[str, ...] = ()
    ends_in_tool_call: bool = False
    tool_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert (self.arrival_s is None) == (self.parent is not None), (
            f"{self.request_id}: arrival_s is None exactly when parent is set")
        assert not self.prefix_from_parent or self.parent is not None, (
            f"{self.request_id}: prefix_from_parent needs a parent")
        assert self.input_length >= 1 and self.output_length >= 1, (
            f"{self.request_id}: input_length={self.input_length} "
            f"output_length={self.output_length}: both >= 1")
        assert self.think_s >= 0, f"{self.request_id}: think_s={self.think_s} < 0"
        assert self.ends_in_tool_call == bool(self.tool_names), (
            f"{self.request_id}: ends_in_tool_call iff tool_names")


class TraceError(ValueError):
    """A trace line that cannot be read: names the file, the line number and the field."""


def load_mooncake(
    path: str | Path, block_size: int = 512, limit: int | None = None
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``, optional ``session_id``); blank lines are skipped, other keys ignored.

    Every request is open loop (``arrival_s = timestamp / 1000``) with its full ``hash_ids``.
    NOTE: a ``session_id`` is kept as the request's session (the affinity key a client would
    send) but does not make turns closed loop: the trace fixes every arrival, and a session's
    next turn may arrive while the previous one still runs, as recorded. Turn order within a
    session is the file's order, so a harness can find a turn's predecessor itself.

    Returns the requests in arrival order (stable for equal timestamps).

    Raises:
        TraceError: a bad line (not JSON, a field missing or of the wrong type, or
            ``len(hash_ids) != ceil(input_length / block_size)``, usually a wrong block size).
        FileNotFoundError: no such file.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    out = [req for req in _read_mooncake(Path(path), block_size, limit)]
    out.sort(key=lambda r: r.arrival_s)  # type: ignore[arg-type,return-value]
    return out


def agent_workload(
    seed: int, num_sessions: int = 64, params: AgentParams | None = None, block_size: int = 512
) -> list[TraceRequest]:
    """The built-in agent-session workload (``--synthetic agent``), deterministic per seed.

    ``num_sessions`` top-level sessions start open loop (Poisson, ``params.session_rate_per_s``);
    their turns and the sub-agent sessions they spawn are closed loop. ``AgentParams`` documents
    every knob and its source.
    """
    if num_sessions < 0:
        raise ValueError(f"num_sessions={num_sessions}: must be >= 0")
    return _AgentBuilder(seed, params or AgentParams(), block_size).build(num_sessions)


def first_by_arrival(requests: list[TraceRequest], limit: int) -> list[TraceRequest]:
    """The first ``limit`` requests by estimated arrival whose parents are in too, in the
    list's order: a window of time (``--limit`` of the agent workload), not its first sessions.

    NOTE: a closed-loop arrival is estimated as the parent's + ``think_s`` (service time is
    only known by replaying).
    """
    est: dict[str, float] = {}
    for r in requests:
        est[r.request_id] = r.arrival_s if r.parent is None else est[r.parent] + r.think_s
    keep = {r.request_id for r in sorted(requests, key=lambda r: est[r.request_id])[:max(0, limit)]}
    out: list[TraceRequest] = []
    for r in requests:
        if r.request_id in keep and (r.parent is None or r.parent in keep):
            out.append(r)
        else:
            keep.discard(r.request_id)
    return out


def new_tokens(req: TraceRequest, parent: TraceRequest | None) -> int:
    """The tokens ``req`` adds to its prompt (its whole prompt without ``prefix_from_parent``)."""
    if not req.prefix_from_parent:
        return req.input_length
    assert parent is not None and parent.request_id == req.parent
    return req.input_length - parent.input_length - parent.output_length


def summary(requests: list[TraceRequest]) -> dict[str, float]:
    """Counts for a log line: requests, sessions, input/output tokens, closed-loop share."""
    sessions = {r.session_id for r in requests if r.session_id is not None}
    return {
        "requests": len(requests),
        "sessions": len(sessions),
        "input_tokens": sum(r.input_length for r in requests),
        "output_tokens": sum(r.output_length for r in requests),
        "max_input_tokens": max((r.input_length for r in requests), default=0),
        "closed_loop": sum(r.parent is not None for r in requests),
    }


# --------------------------------------------------------------------------- Mooncake


def _read_mooncake(path: Path, block_size: int, limit: int | None) -> Iterator[TraceRequest]:
    count = 0
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            yield _mooncake_record(line, f"{path}:{line_no}", block_size, count)
            count += 1


def _mooncake_record(line: str, where: str, block_size: int, index: int) -> TraceRequest:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    timestamp = _number(rec, "timestamp", where)
    input_length = _int(rec, "input_length", where, minimum=1)
    output_length = _int(rec, "output_length", where, minimum=1)
    hash_ids = rec.get("hash_ids", _MISSING)
    if hash_ids is _MISSING:
        raise TraceError(f"{where}: field 'hash_ids' is missing")
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    expected = math.ceil(input_length / block_size)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} blocks, but input_length "
            f"{input_length} at block size {block_size} needs {expected} (wrong --block-size?)")
    return TraceRequest(
        request_id=f"r{index}", session_id=_session_id(rec, where), tenant="default",
        arrival_s=timestamp / 1000.0, parent=None, think_s=0.0, prefix_from_parent=False,
        hash_ids=tuple(hash_ids), input_length=input_length, output_length=output_length,
    )


_MISSING = object()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(rec: dict, name: str, where: str) -> float:
    value = rec.get(name, _MISSING)
    if value is _MISSING:
        raise TraceError(f"{where}: field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or (
            not math.isfinite(value)):
        raise TraceError(f"{where}: field '{name}' must be a number >= 0, got {value!r}")
    return float(value)


def _int(rec: dict, name: str, where: str, minimum: int) -> int:
    value = rec.get(name, _MISSING)
    if value is _MISSING:
        raise TraceError(f"{where}: field '{name}' is missing")
    if not _is_int(value) or value < minimum:
        raise TraceError(f"{where}: field '{name}' must be an integer >= {minimum}, "
                         f"got {value!r}")
    return value


def _session_id(rec: dict, where: str) -> str | None:
    value = rec.get("session_id")
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if _is_int(value):
        return str(value)
    raise TraceError(f"{where}: field 'session_id' must be a non-empty string or an integer, "
                     f"got {value!r}")


# --------------------------------------------------------------------------- agent workload


@dataclass(slots=True)
class _Turn:
    """A turn being built (the last one of a session so far)."""

    req: TraceRequest
    context_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.context_tokens = self.req.input_length + self.req.output_length


class _AgentBuilder:
    def __init__(self, seed: int, params: AgentParams, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.rng = random.Random(seed)
        self.p, self.block_size = params, block_size
        self.next_block = 0
        self.system_blocks = [self._blocks(t) for t in params.system_prompt_tokens]
        self.out: list[TraceRequest] = []

    def build(self, num_sessions: int) -> list[TraceRequest]:
        start_s = 0.0
        for i in range(num_sessions):
            start_s += self.rng.expovariate(self.p.session_rate_per_s)
            self._main_session(f"agent-{i}", start_s)
        return self.out

    def _main_session(self, session_id: str, start_s: float) -> None:
        p, rng = self.p, self.rng
        tenant = rng.choices([t for t, _ in p.tenants], weights=[w for _, w in p.tenants])[0]
        variant = rng.randrange(len(self.system_blocks))
        task = _lognormal_int(rng, p.task_tokens)
        system_tokens = len(self.system_blocks[variant]) * self.block_size
        blocks = (*self.system_blocks[variant], *self._blocks(task))
        num_turns = _lognormal_int(rng, p.turns)
        turn = self._first_turn(session_id, tenant, start_s, blocks, system_tokens + task,
                                is_last=num_turns == 1)
        for t in range(1, num_turns):
            spawn = p.subagent_turn_prob > 0 and rng.random() < p.subagent_turn_prob
            is_last = t == num_turns - 1
            if spawn and not is_last:
                nxt = self._spawn(session_id, t, turn)
            else:
                nxt = self._next_turn(f"{session_id}-t{t}", session_id, turn, is_last)
            if nxt is None:
                return
            turn = nxt

    def _spawn(self, session_id: str, t: int, prev: _Turn) -> _Turn | None:
        """``prev``'s answer calls the ``task`` tool: k sub-agents start together from its
        context; the main session resumes after ``task``'s pause with their summaries."""
        p, rng = self.p, self.rng
        spawner = self._next_turn(f"{session_id}-t{t}", session_id, prev, is_last=False,
                                  tools=("task",))
        if spawner is None:
            return None
        k = min(p.subagents.max_value, max(2, _lognormal_int(rng, p.subagents)))
        base_s = p.fanout_delay_s
        for j in range(k):
            think_s = base_s + rng.uniform(0.0, p.sibling_jitter_s)
            self._sub_session(f"{session_id}.sub{t}-{j}", spawner, think_s)
        return spawner

    def _sub_session(self, session_id: str, spawner: _Turn, think_s: float) -> None:
        num_turns = _lognormal_int(self.rng, self.p.subagent_turns)
        task = _lognormal_int(self.rng, self.p.subagent_task_tokens)
        turn = self._turn(f"{session_id}-t0", session_id, spawner, task, think_s,
                          is_last=num_turns == 1, tools=None)
        for t in range(1, num_turns):
            if turn is None:
                return
            turn = self._next_turn(f"{session_id}-t{t}", session_id, turn, t == num_turns - 1)

    def _first_turn(self, session_id: str, tenant: str, arrival_s: float,
                    blocks: tuple[int, ...], input_length: int, is_last: bool) -> _Turn:
        tools = () if is_last else self._tool_calls()
        req = TraceRequest(
            request_id=f"{session_id}-t0", session_id=session_id, tenant=tenant,
            arrival_s=arrival_s, parent=None, think_s=0.0, prefix_from_parent=False,
            hash_ids=blocks, input_length=input_length,
            output_length=_lognormal_int(self.rng, self.p.output_tokens),
            ends_in_tool_call=bool(tools), tool_names=tools,
        )
        self.out.append(req)
        return _Turn(req)

    def _next_turn(self, request_id: str, session_id: str, prev: _Turn, is_last: bool,
                   tools: tuple[str, ...] | None = None) -> _Turn | None:
        """The turn after ``prev``: a tool result after the tool's pause, or a user message
        after the user's think time. None: the history would outgrow the context."""
        rng, p = self.rng, self.p
        names = prev.req.tool_names
        if names:
            spec = TOOLS[names[0]]
            new = sum(_lognormal_int(rng, TOOLS[n].result_tokens) for n in names)
            think_s = spec.pause_s(rng, p.pause_sigma)
        else:
            new = _lognormal_int(rng, p.task_tokens)
            think_s = rng.lognormvariate(math.log(p.user_think_median_s), p.user_think_sigma)
        return self._turn(request_id, session_id, prev, new, think_s, is_last, tools)

    def _turn(self, request_id: str, session_id: str, prev: _Turn, new: int, think_s: float,
              is_last: bool, tools: tuple[str, ...] | None) -> _Turn | None:
        output = _lognormal_int(self.rng, self.p.output_tokens)
        input_length = prev.context_tokens + new
        if input_length + output > self.p.max_context_tokens:
            return None
        if tools is None:
            tools = () if is_last else self._tool_calls()
        req = TraceRequest(
            request_id=request_id, session_id=session_id, tenant=prev.req.tenant,
            arrival_s=None, parent=prev.req.request_id, think_s=think_s,
            prefix_from_parent=True, hash_ids=self._blocks(new), input_length=input_length,
            output_length=output, parent_tool_names=prev.req.tool_names,
            ends_in_tool_call=bool(tools), tool_names=tools,
        )
        self.out.append(req)
        return _Turn(req)

    def _tool_calls(self) -> tuple[str, ...]:
        """A non-final turn's tool calls: usually one, sometimes a few in parallel; or none
        (the agent asks the user)."""
        rng, p = self.rng, self.p
        if rng.random() >= p.tool_call_prob:
            return ()
        names = [n for n in TOOLS if n != "task"]
        weights = [TOOLS[n].weight for n in names]
        count = 1 if rng.random() >= p.parallel_tools_prob else rng.randint(2, 3)
        return tuple(rng.choices(names, weights=weights, k=count))

    def _blocks(self, num_tokens: int) -> tuple[int, ...]:
        n = math.ceil(num_tokens / self.block_size)
        first, self.next_block = self.next_block, self.next_block + n
        return tuple(range(first, first + n))


def _lognormal_int(rng: random.Random, dist: LogNormal) -> int:
    """A draw from a ``LogNormal`` knob (median, sigma, clipped to [min_value, max_value])."""
    value = rng.lognormvariate(math.log(dist.median), dist.sigma)
    return int(min(dist.max_value, max(dist.min_value, round(value))))
