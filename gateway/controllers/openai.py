"""OpenAI-compatible endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON,
or SSE with ``stream``), ``GET /v1/models`` and ``GET /v1/models/{id}``.

A request goes: decode (``RequestError`` names the parameter; the cheap bounds of
``gateway.schemas.limits``) -> model name (404 ``model_not_found``) -> characters against the
context -> prompt ids (``PromptCache`` for chat) -> ``to_sampling_spec`` -> ``generation.start``
-> ``generation.chat_deltas`` / ``chat_result`` / ``pieces``; this module only shapes the OpenAI
bodies and SSE events. An error after the first token can only be an SSE ``error`` event,
followed by ``[DONE]``.

NOTE: decoding, rendering and tokenizing an input over ``large_input_chars`` run on a thread
(at most ``PROMPT_THREADS`` at once), so that one huge body never stalls the event loop; small
ones stay inline, where a thread hop would cost more than the work.
"""

import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import jinja2
import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from engine.protocol import Finished, MediaSpan, TokenDelta
from gateway import sse
from gateway.affinity_keys import affinity_key
from gateway.disconnect import read_body, until_disconnect
from gateway.dispatch import DispatchError
from gateway.generation import (
    ChatDelta,
    OutputOptions,
    Started,
    build_generate,
    chat_deltas,
    chat_result,
    check_context,
    finish_reason,
    new_request_id,
    pieces,
    tool_parser,
    usage_of,
)
from gateway.lean_request import HttpRequest
from gateway.lifespan import ModelState
from gateway.logprobs import TokenTexts
from gateway.media import Media, MediaPipeline
from gateway.prompt_cache import EncodedPrompt
from gateway.request_stream import Push
from gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Message,
    Model,
    ModelList,
    RequestError,
    Usage,
    decode_chat_request,
    decode_completion_request,
    error_body,
    to_sampling_spec,
)
from gateway.schemas.decode import check_logit_bias, check_max_tokens, prompt_chars
from gateway.schemas.limits import DEFAULT_LIMITS, max_prompt_chars
from gateway.stream_push import delta_push, pushable
from gateway.tenancy import ANONYMOUS, cache_salt, tenant_of
from gateway.tokenizer import StreamDecoder
from gateway.tool_parser import ToolCallStreamParser
from gateway.tool_pauses import answered, note_calls, start_stateless, watch_stream

_JSON = msgspec.json.Encoder()
CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
PROMPT_THREADS = 2  # NOTE: large inputs at once; more would only share the same cores
_T = TypeVar("_T")
_Req = TypeVar("_Req", ChatCompletionRequest, CompletionRequest)
# NOTE: what a generation endpoint answers: a JSON body, or the SSE events of a stream
Answer = msgspec.Struct | AsyncIterator[bytes]


class ModelsController(Controller):
    path = "/v1/models"

    @get(sync_to_thread=False)
    def list_models(self, request: Request[Any, Any, Any]) -> ModelList:
        return ModelList(data=[Model(id=name) for name in served_names(request)])

    @get("/{model_id:path}", sync_to_thread=False)
    def retrieve(self, request: Request[Any, Any, Any], model_id: FromPath[str]) -> Model:
        name = model_id.removeprefix("/")
        check_model(request, name)
        return Model(id=name)


class CompletionsController(Controller):
    path = COMPLETIONS_PATH

    @post(status_code=200)
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        # NOTE: a client that leaves before the answer must not leave its request running
        return as_response(await until_disconnect(request, completion(request)))


async def completion(request: HttpRequest) -> Answer:
    """``POST /v1/completions``: the JSON body, or the SSE events."""
    model, req = await _read(request, decode_completion_request)
    prompt = req.prompt
    if isinstance(prompt, str):
        _check_prompt_chars(len(prompt), model, "prompt")
        prompt = await _maybe_off_loop(request, len(prompt), model.tokenizer.encode, prompt)
    _check_vocab(prompt, model.vocab_size)
    salt = cache_salt(tenant_of(request))
    head, started = await _start(request, model, req, list(prompt), "prompt", salt)
    if req.stream:
        return _completion_sse(head, req, started, model)
    return await _completion(head, req, started, model)


class ChatCompletionsController(Controller):
    path = CHAT_COMPLETIONS_PATH

    @post(status_code=200)
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        # NOTE: a client that leaves before the answer must not leave its request running
        return as_response(await until_disconnect(request, chat_completion(request)))


def as_response(answer: Answer) -> Response[Any]:
    """A litestar response of an answer (the lane, ``gateway.lane``, writes answers itself)."""
    if isinstance(answer, msgspec.Struct):
        return Response(answer)
    return sse.response(answer)


async def chat_completion(request: HttpRequest) -> Answer:
    """``POST /v1/chat/completions``: the JSON body, or the SSE events."""
    model, req = await _read(request, decode_chat_request)
    num_chars = prompt_chars(req.messages)
    _check_prompt_chars(num_chars, model, "messages")
    salt = cache_salt(tenant_of(request))
    # NOTE: the media are fetched and checked first; their encode runs while the prompt is
    # rendered and tokenized, and is awaited before the request is sent
    media = await start_media(request, req.messages, salt)
    try:
        prompt = await _maybe_off_loop(request, num_chars, _chat_prompt, req, model, salt)
        input_ids, spans = prompt.token_ids, []
        if media is not None:
            input_ids, spans = media.expand(input_ids)
            await media.encoded()
    except BaseException:
        if media is not None:
            media.cancel()
        raise
    head, started = await _start(request, model, req, input_ids, "messages", salt,
                                 prompt.conversation, spans)
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    opts = OutputOptions(req.stop_strings, parse_tools, logprobs=bool(req.logprobs))
    if req.stream:
        if req.continuous_usage:
            started = _counting(started, len(input_ids))
        calls: dict[int, list[str]] = {}  # NOTE: the tool calls streamed, pushed ones too
        watch = functools.partial(watch_stream, request.app.state.dispatcher, head.id, salt,
                                  calls=calls)
        return sse.EventStream(
            lambda out: _chat_sse(head, req, started, model, opts, watch, out, calls))
    result = await chat_result(started, model, opts)
    answered(request.app.state.dispatcher, head.id, salt, result.message.tool_calls,
             result.finish_reason, result.usage)
    logprobs = None if result.logprobs is None else ChoiceLogprobs(content=result.logprobs)
    choice = ChatChoice(
        index=0, message=result.message, finish_reason=result.finish_reason, logprobs=logprobs
    )
    return ChatCompletion(
        id=head.id, model=head.model, choices=[choice], usage=result.usage,
        created=head.created,
    )


def _model(request: HttpRequest) -> ModelState:
    """The app's model (and ``state.dispatcher``). NOTE: read from the app state rather than
    injected: on this hot path litestar's dependency resolution (an anyio task group per
    request) cost ~10 % of the gateway's CPU per request (``loadtest/bench_gateway.py``)."""
    return request.app.state.model


class _Head(msgspec.Struct, frozen=True):
    """What every body and chunk of one response repeats."""

    id: str
    model: str
    created: int


async def _read(
    request: HttpRequest, decode: Callable[[bytes], _Req]
) -> tuple[ModelState, _Req]:
    """The app's model and the request's body, decoded (off the loop when large) and checked."""
    model = _model(request)
    body = await read_body(request)
    req = await _maybe_off_loop(request, len(body), decode, body)
    _check_request(request, req, model)
    return model, req


async def _start(
    request: HttpRequest,
    model: ModelState,
    req: ChatCompletionRequest | CompletionRequest,
    input_ids: list[int],
    param: str,
    salt: str | None,
    conversation: int | None = None,
    media: Sequence[MediaSpan] = (),
) -> tuple[_Head, Started]:
    """Check the context (a 400 ``context_length_exceeded`` on ``param`` or the max-tokens
    field), send the request, await its first item. ``conversation``: the prompt cache's name
    of the chat (``EncodedPrompt.conversation``), so that routing hashes only its new pages."""
    left = check_context(model, len(input_ids), param)
    check_max_tokens(req, len(input_ids), model.max_context)
    spec = to_sampling_spec(
        req, default_max_tokens=left, stop_token_ids=model.tokenizer.eos_token_ids
    )
    prefix = "chatcmpl" if param == "messages" else "cmpl"
    key = affinity_key(request.headers, getattr(req, "prompt_cache_key", None), req.user)
    generate = build_generate(
        input_ids, spec, request_id=new_request_id(prefix), cache_salt=salt, stream=req.stream,
        # NOTE: the worker's session hint, per tenant as the route's key
        session_id=None if key is None else f"{salt or ANONYMOUS}/{key}",
        stop_strings=req.stop_strings, media=media,
    )
    # NOTE: a chat request answering a retained tool-call answer releases it (tool_pauses)
    started = await start_stateless(
        request.app.state.dispatcher, generate, key, getattr(req, "messages", None), salt,
        conversation)
    return _Head(generate.request_id, served_names(request)[0], int(time.time())), started


def served_names(request: HttpRequest) -> tuple[str, ...]:
    """The names the model answers to (``GatewayConfig.served_model_names``; empty:
    ``model_name`` or the model directory's name); the first is the one in responses."""
    cfg = request.app.state.cfg
    return cfg.served_model_names or (cfg.model_name or cfg.model_dir.name,)


def check_model(request: HttpRequest, name: str) -> None:
    if name not in served_names(request):
        raise RequestError(
            f"The model '{name}' does not exist; this gateway serves "
            f"{', '.join(served_names(request))}.",
            param="model", code="model_not_found", status=404,
        )


def _check_request(
    request: HttpRequest,
    req: ChatCompletionRequest | CompletionRequest,
    model: ModelState,
) -> None:
    check_model(request, req.model)
    check_logit_bias(req.logit_bias, model.vocab_size or model.tokenizer.vocab_size)


def _check_prompt_chars(num_chars: int, model: ModelState, param: str) -> None:
    """Refuse, before tokenizing, a prompt too long for the context whatever its tokens."""
    bound = max_prompt_chars(model.max_context, model.tokenizer.max_token_chars)
    if num_chars > bound:
        raise RequestError(
            f"The {param} hold {num_chars} characters: more than this model's context of "
            f"{model.max_context} tokens can hold (at most {bound} characters).",
            param=param, code="context_length_exceeded",
        )


async def _maybe_off_loop(
    request: HttpRequest, size: int, fn: Callable[..., _T], *args: Any
) -> _T:
    """``fn(*args)``, on a thread when ``size`` (characters or bytes) is large."""
    if size <= DEFAULT_LIMITS.large_input_chars:
        return fn(*args)
    state = request.app.state
    if "prompt_limiter" not in state:
        state.prompt_limiter = anyio.CapacityLimiter(PROMPT_THREADS)
    return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=state.prompt_limiter)


def _counting(started: Started, num_prompt_tokens: int) -> Started:
    """``started`` with a running ``usage`` (prompt and completion tokens so far) attached, for
    ``continuous_usage_stats``."""
    counted = _CountingStarted(started.request_id, started.first, started.stream,
                               image_tokens=started.image_tokens)
    counted.prompt_tokens = num_prompt_tokens
    return counted


class _CountingStarted(Started):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    async def items(self) -> AsyncIterator[Any]:
        async for item in super().items():
            if isinstance(item, TokenDelta):
                self.completion_tokens += len(item.token_ids)
            yield item

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens)


async def start_media(request: HttpRequest, messages: Sequence[Message],
                      salt: str | None) -> Media | None:
    """The request's media fetched, checked and keyed, their encode started
    (``gateway.media``); None without media parts. An app without a media pipeline (tests
    that build one by hand) takes no media."""
    pipeline = getattr(request.app.state, "media", None) or _NO_MEDIA
    return await pipeline.start(messages, salt)


_NO_MEDIA = MediaPipeline(None, {"image": None, "video": None})


def _check_vocab(token_ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            msg = f"token id {token_id} is outside this model's vocabulary [0, {vocab_size})"
            raise RequestError(msg, param=f"prompt[{i}]")


def _chat_prompt(
    req: ChatCompletionRequest, model: ModelState, salt: str | None
) -> EncodedPrompt:
    """The prompt (thread-safe: ``PromptCache`` locks its state)."""
    messages = msgspec.to_builtins(req.messages)
    tools = msgspec.to_builtins(req.tools) if req.tools else None
    try:
        return model.prompt_cache.encode(messages, tools, cache_salt=salt)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RequestError(f"messages could not be rendered: {exc}", param="messages") from None


def _error_event(exc: DispatchError) -> bytes:
    return sse.json_event(error_body(str(exc), type="server_error"))


def _chunk(
    head: _Head,
    delta: ChunkDelta,
    reason: Any = None,
    logprobs: ChoiceLogprobs | None = None,
    usage: Usage | msgspec.UnsetType = msgspec.UNSET,
) -> bytes:
    choice = ChunkChoice(index=0, delta=delta, finish_reason=reason, logprobs=logprobs)
    return sse.json_event(ChatCompletionChunk(
        id=head.id, model=head.model, created=head.created, choices=[choice], usage=usage
    ))


async def _chat_sse(
    head: _Head,
    req: ChatCompletionRequest,
    started: Started,
    model: ModelState,
    opts: OutputOptions,
    watch: Callable[[AsyncIterator[Any]], AsyncIterator[Any]],
    out: sse.EventStream,
    calls: dict[int, list[str]],
) -> AsyncIterator[bytes]:
    """The SSE body; leaving it early (the client went away) aborts the worker request.
    ``watch`` passes the events through (``tool_pauses.watch_stream``: tool-pause retention;
    ``calls``, its notes of the streamed tool calls). ``out``: the body this feeds; when it has
    a writer (the lane), deltas are written from the worker's reply, past every layer here
    (``stream_push.pushable``, ``_delta_push``)."""
    decoder = StreamDecoder(model.tokenizer, skip_special_tokens=True)
    parser = tool_parser(started, opts)
    events = watch(chat_deltas(started, model, opts, decoder, parser))
    # NOTE: a content-only delta (the common one) from bytes made once (gateway.sse)
    fast = None if isinstance(started, _CountingStarted) else \
        sse.ContentChunks(head.id, head.model, head.created)

    def usage() -> Usage | msgspec.UnsetType:
        return started.usage() if isinstance(started, _CountingStarted) else msgspec.UNSET

    try:
        yield _chunk(head, ChunkDelta(role="assistant", content=""), usage=usage())
        # NOTE: here the role chunk has been written: pushed chunks can only come after it
        if out.writer is not None and fast is not None and fast.usable and pushable(opts) and \
                started.push_to is not None:
            started.push_to(_delta_push(head, decoder, parser, calls, fast, out.writer))
        async for event in events:
            logprobs = None if event.logprobs is None else ChoiceLogprobs(content=event.logprobs)
            if isinstance(event, ChatDelta):
                delta = event.delta
                if fast is not None and logprobs is None and delta.role is None \
                        and delta.tool_calls is None and delta.content is not None \
                        and (chunk := fast.encode(delta.content)) is not None:
                    yield chunk
                    continue
                yield _chunk(head, delta, logprobs=logprobs, usage=usage())
                continue
            yield _chunk(head, ChunkDelta(), event.finish_reason, logprobs, usage=usage())
            if req.include_usage:
                yield sse.json_event(ChatCompletionChunk(
                    id=head.id, model=head.model, created=head.created, choices=[],
                    usage=event.usage,
                ))
    except DispatchError as exc:
        yield _error_event(exc)
    finally:
        await events.aclose()
    yield sse.DONE


def _delta_push(head: _Head, decoder: StreamDecoder, parser: ToolCallStreamParser | None,
                calls: dict[int, list[str]], fast: sse.ContentChunks,
                writer: sse.BodyWriter) -> Push:
    """The stream's push (``generation.delta_push``): its chunks as ``_chat_sse`` writes them,
    the tool calls noted as ``watch_stream`` notes them."""

    def emit(delta: ChunkDelta) -> bytes:
        if delta.tool_calls is None and delta.content is not None:
            return fast.encode(delta.content)  # type: ignore[return-value]
        note_calls(calls, delta.tool_calls)
        return _chunk(head, delta)

    return delta_push(decoder, parser, writer, emit, fast.encode)  # type: ignore[arg-type]


async def _completion(
    head: _Head, req: CompletionRequest, started: Started, model: ModelState
) -> Completion:
    texts = _CompletionLogprobs(model, req.logprobs)
    text: list[str] = []
    async for piece in pieces(started, model, req.stop_strings):
        if isinstance(piece, Finished):
            choice = CompletionChoice(
                index=0, text="".join(text), finish_reason=finish_reason(piece),
                logprobs=texts.result(),
            )
            return Completion(
                id=head.id, model=head.model, created=head.created, choices=[choice],
                usage=usage_of(piece),
            )
        text.append(piece.text)
        texts.add(piece.token_ids, piece.logprobs, piece.top_logprobs)
    raise AssertionError("a worker stream always ends with Finished")


async def _completion_sse(
    head: _Head, req: CompletionRequest, started: Started, model: ModelState
) -> AsyncIterator[bytes]:
    stream = pieces(started, model, req.stop_strings)
    texts = _CompletionLogprobs(model, req.logprobs)

    def event(text: str, reason: Any = None, **extra: Any) -> bytes:
        choice = CompletionChoice(index=0, text=text, finish_reason=reason, logprobs=texts.take())
        return sse.json_event(Completion(
            id=head.id, model=head.model, created=head.created, choices=[choice], **extra
        ))

    try:
        async for piece in stream:
            if isinstance(piece, Finished):
                usage = usage_of(piece) if req.include_usage else msgspec.UNSET
                yield event("", finish_reason(piece), usage=usage)
                break
            texts.add(piece.token_ids, piece.logprobs, piece.top_logprobs)
            if piece.text:
                yield event(piece.text)
    except DispatchError as exc:
        yield _error_event(exc)
    finally:
        await stream.aclose()
    yield sse.DONE


class _CompletionLogprobs:
    """The legacy completions logprobs shape, accumulated piece by piece (``take`` for SSE)."""

    def __init__(self, model: ModelState, wanted: int | None) -> None:
        self.wanted = wanted is not None
        self._texts = TokenTexts(model.tokenizer)
        self._tokens: list[str] = []
        self._logprobs: list[float] = []
        self._top: list[dict[str, float]] = []
        self._offsets: list[int] = []
        self._offset = 0

    def add(
        self,
        token_ids: list[int],
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None,
    ) -> None:
        if not self.wanted or logprobs is None:
            return
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            text = self._texts.text(token_id)
            self._tokens.append(text)
            self._logprobs.append(logprob)
            self._offsets.append(self._offset)
            self._offset += len(text)
            if top is not None:
                self._top.append({self._texts.text(t): lp for t, lp in top[i]})

    def result(self) -> CompletionLogprobs | None:
        if not self.wanted:
            return None
        return CompletionLogprobs(
            tokens=self._tokens, token_logprobs=self._logprobs,
            top_logprobs=self._top or None, text_offset=self._offsets,
        )

    def take(self) -> CompletionLogprobs | None:
        result = self.result()
        self._tokens, self._logprobs, self._top, self._offsets = [], [], [], []
        return result
