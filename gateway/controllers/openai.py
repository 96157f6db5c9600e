"""OpenAI-compatible endpoints: ``POST /v1/chat/completions`` (JSON, or SSE with ``stream``),
``POST /v1/completions`` (JSON only for now) and ``GET /v1/models``.

A chat request goes: decode (``RequestError`` names the parameter) -> ``PromptCache.encode`` ->
``to_sampling_spec`` -> ``Dispatcher.generate``. The first item of the worker's stream is awaited
before answering, so an error the worker gives before any token (``context_too_long``,
``overloaded``, no worker) becomes an HTTP status even for a streamed request; an error after that
can only be an SSE ``error`` event. Text goes through stop-string matching and then the tool-call
parser, the same way for both modes, so a streamed answer's deltas concatenate to the JSON one.
"""

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from engine.protocol import Finished, Generate
from gateway.dispatch import Dispatcher, DispatchError, StreamItem
from gateway.lifespan import ModelState
from gateway.prompt_cache import EncodedPrompt
from gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    Model,
    ModelList,
    RequestError,
    ResponseMessage,
    ToolCall,
    ToolCallDelta,
    Usage,
    decode_chat_request,
    decode_completion_request,
    error_body,
    to_sampling_spec,
)
from gateway.tokenizer import StreamDecoder
from gateway.tool_parser import (
    ContentDelta,
    ToolCallArgumentsDelta,
    ToolCallEvent,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
)

_JSON = msgspec.json.Encoder()


class ModelsController(Controller):
    path = "/v1/models"

    @get(sync_to_thread=False)
    def list_models(self, model: NamedDependency[ModelState]) -> ModelList:
        return ModelList(data=[Model(id=model.name)])


class CompletionsController(Controller):
    path = "/v1/completions"

    @post(status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        model: NamedDependency[ModelState],
        dispatcher: NamedDependency[Dispatcher],
    ) -> Completion:
        req = decode_completion_request(await request.body())
        if req.stream:
            msg = "stream=true is not supported on /v1/completions yet"
            raise RequestError(msg, param="stream", code="unsupported_value")
        generate = _completion_generate(req, model)
        ids, finished = await _collect(dispatcher.generate(generate))
        return _completion(req, model, generate.request_id, ids, finished)


class ChatCompletionsController(Controller):
    path = "/v1/chat/completions"

    @post(status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        model: NamedDependency[ModelState],
        dispatcher: NamedDependency[Dispatcher],
    ) -> Response[Any]:
        job = _prepare(decode_chat_request(await request.body()), model)
        stream = dispatcher.generate(job.generate)
        try:
            first = await anext(stream)
        except BaseException:
            await stream.aclose()
            raise
        if job.req.stream:
            return ServerSentEvent(_sse(job, first, stream))
        return Response(await _complete(job, first, stream))


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Job:
    req: ChatCompletionRequest
    model: ModelState
    prompt: EncodedPrompt
    generate: Generate
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return self.generate.request_id


def _prepare(req: ChatCompletionRequest, model: ModelState) -> _Job:
    messages = msgspec.to_builtins(req.messages)
    tools = msgspec.to_builtins(req.tools) if req.tools else None
    try:
        prompt = model.prompt_cache.encode(messages, tools)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RequestError(f"messages could not be rendered: {exc}", param="messages") from None
    request = _generate(req, model, prompt.token_ids, "messages", new_request_id())
    return _Job(req, model, prompt, request)


def _generate(
    req: ChatCompletionRequest | CompletionRequest,
    model: ModelState,
    input_ids: list[int],
    param: str,
    request_id: str,
) -> Generate:
    """The worker request; a prompt that leaves no room in the context is a 400 on ``param``."""
    left = model.max_context - len(input_ids)
    if left <= 0:
        raise RequestError(
            f"The prompt is {len(input_ids)} tokens; this model's context is "
            f"{model.max_context} tokens.", param=param, code="context_length_exceeded",
        )
    spec = to_sampling_spec(
        req, default_max_tokens=left, stop_token_ids=model.tokenizer.eos_token_ids
    )
    return Generate(request_id=request_id, input_ids=input_ids, sampling=spec)


def _completion_generate(req: CompletionRequest, model: ModelState) -> Generate:
    ids = model.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return _generate(req, model, ids, "prompt", f"cmpl-{uuid.uuid4().hex}")


async def _collect(
    stream: AsyncIterator[StreamItem], first: StreamItem | None = None
) -> tuple[list[int], Finished]:
    """All token ids and the ``Finished``; the stream is closed (so aborted) if this is left."""
    ids: list[int] = []
    try:
        item = first if first is not None else await anext(stream)
        while not isinstance(item, Finished):
            ids.extend(item.token_ids)
            item = await anext(stream)
        return ids, item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _completion(
    req: CompletionRequest, model: ModelState, request_id: str, ids: list[int], item: Finished
) -> Completion:
    stop = _StopMatcher(req.stop_strings)
    text = stop.feed(model.tokenizer.decode(ids, skip_special_tokens=True)) + stop.flush()
    reason = _finish_reason(item, stop.stopped, has_calls=False)
    choice = CompletionChoice(index=0, text=text, finish_reason=reason)
    return Completion(
        id=request_id, model=model.name, created=int(time.time()), choices=[choice],
        usage=_usage(item),
    )


class _StopMatcher:
    """Cuts text at the first stop string; holds back what could be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        text = self._held + text
        cuts = [i for s in self.stops if (i := text.find(s)) >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return text[: min(cuts)]
        keep = max(len(s) - 1 for s in self.stops)
        emit = len(text) - keep
        while emit < len(text) and not any(s.startswith(text[max(emit, 0):]) for s in self.stops):
            emit += 1
        emit = max(emit, 0)
        self._held = text[emit:]
        return text[:emit]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _finish_reason(item: Finished, stopped: bool, has_calls: bool) -> Any:
    if has_calls:
        return "tool_calls"
    return "length" if item.finish_reason == "length" and not stopped else "stop"


def _usage(item: Finished) -> Usage:
    return Usage.of(item.prompt_tokens, item.completion_tokens, item.cached_tokens)


async def _rest(first: StreamItem, stream: AsyncIterator[StreamItem]) -> AsyncIterator[StreamItem]:
    yield first
    if not isinstance(first, Finished):
        async for item in stream:
            yield item


async def _complete(
    job: _Job, first: StreamItem, stream: AsyncIterator[StreamItem]
) -> ChatCompletion:
    ids, finished = await _collect(stream, first)
    stop = _StopMatcher(job.req.stop_strings)
    text = stop.feed(job.model.tokenizer.decode(ids, skip_special_tokens=True)) + stop.flush()
    parsed = parse_tool_calls(text, id_seed=job.id)
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.tool_calls
    ]
    message = ResponseMessage(content=parsed.content or None, tool_calls=calls or None)
    reason = _finish_reason(finished, stop.stopped, bool(calls))
    choice = ChatChoice(index=0, message=message, finish_reason=reason)
    return ChatCompletion(
        id=job.id, model=job.model.name, choices=[choice], usage=_usage(finished),
        created=job.created,
    )


def _event(data: str) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=data, sep="\n")


def _chunk(job: _Job, delta: ChunkDelta, reason: Any = None) -> ServerSentEventMessage:
    choice = ChunkChoice(index=0, delta=delta, finish_reason=reason)
    chunk = ChatCompletionChunk(
        id=job.id, model=job.model.name, created=job.created, choices=[choice]
    )
    return _event(_JSON.encode(chunk).decode())


def _delta(event: ToolCallEvent) -> ChunkDelta | None:
    if isinstance(event, ContentDelta):
        return ChunkDelta(content=event.text) if event.text else None
    if isinstance(event, ToolCallStart):
        fn = FunctionCallDelta(name=event.name, arguments="")
        call = ToolCallDelta(index=event.index, id=event.id, type="function", function=fn)
        return ChunkDelta(tool_calls=[call])
    if isinstance(event, ToolCallArgumentsDelta):
        fn = FunctionCallDelta(arguments=event.text)
        return ChunkDelta(tool_calls=[ToolCallDelta(index=event.index, function=fn)])
    return None  # ToolCallEnd, ToolCallError: nothing to send


async def _sse(
    job: _Job, first: StreamItem, stream: AsyncIterator[StreamItem]
) -> AsyncIterator[ServerSentEventMessage]:
    """The SSE body; leaving it early (the client went away) aborts the worker request."""
    decoder = StreamDecoder(job.model.tokenizer, skip_special_tokens=True)
    stop = _StopMatcher(job.req.stop_strings)
    parser = ToolCallStreamParser(id_seed=job.id)
    try:
        yield _chunk(job, ChunkDelta(role="assistant", content=""))
        finished: Finished | None = None
        async for item in _rest(first, stream):
            if isinstance(item, Finished):
                finished = item
                break
            text = stop.feed("".join(decoder.feed(t) for t in item.token_ids))
            for event in parser.feed(text):
                if (delta := _delta(event)) is not None:
                    yield _chunk(job, delta)
        assert finished is not None
        events = parser.feed(stop.feed(decoder.flush()) + stop.flush()) + parser.finish()
        for event in events:
            if (delta := _delta(event)) is not None:
                yield _chunk(job, delta)
        reason = _finish_reason(finished, stop.stopped, parser.num_calls > 0)
        yield _chunk(job, ChunkDelta(), reason)
        if job.req.include_usage:
            usage = ChatCompletionChunk(
                id=job.id, model=job.model.name, created=job.created, choices=[],
                usage=_usage(finished),
            )
            yield _event(_JSON.encode(usage).decode())
    except DispatchError as exc:
        yield _event(_JSON.encode(error_body(str(exc), type="server_error")).decode())
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield _event("[DONE]")
