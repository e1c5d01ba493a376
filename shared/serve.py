"""`rlfleet serve`: the local model behind an OpenAI-compatible chat-completions API on 127.0.0.1.

It answers with the base model plus the adapter `CURRENT` names, checked before every answer, so a
promotion or rollback is live on the next request; a request that names a scope (the model
``<model>@<scope key>`` or the ``X-Rlfleet-Scope`` header: shared/scopes.py) is answered by that scope's
own adapter, several of which stay loaded at once. Besides the standard reply it returns an
``rlfleet`` object: the adapter version, the prompt as built (system prompt included), and the token
ids with their raw log-probs under the answering policy, which the bots store as the behaviour policy
of the answer (the trainer's importance ratios need exactly that quantity). With ``stream: true`` the
answer comes as OpenAI's server-sent ``chat.completion.chunk`` events, text as it is generated, and
the ``rlfleet`` object rides on the last chunk (the one with the ``finish_reason``). Whole answers
asked for while the model is busy are answered together in one batched generate (:class:`Batcher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import scopes
from .compute_thread import on_compute_thread_async
from .errors import ContextTooLong
from .events import MAX_MESSAGES, MAX_PROMPT_CHARS, Source, describe_validation_error
from .stop_strings import MAX_STOP_CHARS, MAX_STOPS, StopFilter
from .webserver import listening, until_cancelled

log = logging.getLogger(__name__)

# JSON may write each character of a prompt as a \uXXXX escape: a prompt within MAX_PROMPT_CHARS fits.
MAX_BODY_BYTES = 6 * MAX_PROMPT_CHARS + (1 << 16)
# Whose adapter answers (shared/scopes.py): this header, or the model name `<served model>@<scope key>`.
SCOPE_HEADER = "X-Rlfleet-Scope"


class _Part(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[_Part]

    @model_validator(mode="before")
    @classmethod
    def _role(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("role") == "developer":  # OpenAI's newer name for the system prompt
            return {**v, "role": "system"}
        if isinstance(v, dict) and (v.get("role") in ("tool", "function") or v.get("tool_calls")):
            raise ValueError("tool calls and their results are not supported: this server answers in text only")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat-completions request we honour; others (``user``, ``n=1``...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    logprobs: bool = False
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOPS)
    # Asked for, these would silently not be honoured: refused instead (_unsupported)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatRequest:
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tools (function calling) are not supported: this server answers in text only")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported: only text")
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported: logprobs=true gives each drawn token's own")
        return self

    @field_validator("messages")
    @classmethod
    def _size(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if sum(len(m.text()) for m in v) > MAX_PROMPT_CHARS:
            raise ValueError(f"messages exceed {MAX_PROMPT_CHARS:,} characters")
        if not any(m.role == "user" and m.text().strip() for m in v):
            raise ValueError("no non-empty user message")
        if v[-1].role == "assistant" and not v[-1].text().strip():  # shared/chat_prompt: a prefill
            raise ValueError("a last assistant message is a prefill the answer continues: it must not be blank")
        return v


def _error_body(message: str, kind: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response(_error_body(message, kind, code), status=status)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, a wrong method, a body over the cap) in OpenAI's error
    shape, as the routes' own are: clients parse that, not aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        asked = f"{request.method} {request.path[:200]}"
        if isinstance(exc, web.HTTPNotFound):
            served = ", ".join(sorted({f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                                       if r.method != "HEAD" and r.resource is not None}))
            return _error(404, f"no such endpoint: {asked} (this server has {served})", "not_found_error")
        if isinstance(exc, web.HTTPMethodNotAllowed):
            return _error(405, f"{asked}: use {' or '.join(sorted(exc.allowed_methods))}")
        return _error(exc.status, exc.text or exc.reason)


def request_scope(model: str | None, header: str | None, model_name: str) -> str | None:
    """The scope key a request asks to be answered by (None: the shared one), from the model name
    ``<served model>@<key>`` or the :data:`SCOPE_HEADER`; ValueError for a model not served here, a key
    that is not one, or two keys that disagree."""
    named = None
    if model not in (None, model_name):
        base, sep, key = model.partition("@")
        if not sep or base != model_name:
            raise LookupError(f"model {model[:120]!r} is not served here (this server has {model_name!r}; "
                              f"a scope's adapter: {model_name}@<scope>)")
        named = scopes.parse_key(key, get_args(Source))
    given = scopes.parse_key(header.strip(), get_args(Source)) if header is not None else None
    if named is not None and given is not None and named != given:
        raise ValueError(f"the model name asks for scope {named!r} and {SCOPE_HEADER} for {given!r}")
    asked = named or given
    return None if asked in (None, scopes.SHARED) else asked


def _extension(answer) -> dict:
    """rlfleet's own object beside OpenAI's fields: what the bots store as the answer's behaviour policy."""
    return {
        "adapter_version": answer.adapter_version,
        "token_ids": answer.token_ids,
        "logprobs": answer.logprobs,
        "messages": answer.messages,
    }


def _logprobs(answer, tokenizer) -> dict:
    return {"content": [
        {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(answer.token_ids, answer.logprobs, strict=False)
    ]}


def _usage(answer) -> dict:
    """OpenAI's usage object: clients read all three counts."""
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.new_tokens,
            "total_tokens": answer.prompt_tokens + answer.new_tokens}


def completion_body(req: ChatRequest, answer, model_name: str, tokenizer) -> dict:
    """The OpenAI-shaped response for one answer, with rlfleet's extension object."""
    body: dict = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": f"rlfleet-{answer.adapter_version or 'base'}",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": answer.text},
            "finish_reason": answer.finish_reason,
        }],
        "usage": _usage(answer),
        "rlfleet": _extension(answer),
    }
    if req.logprobs:
        body["choices"][0]["logprobs"] = _logprobs(answer, tokenizer)
    return body


class _Chunks:
    """The ``chat.completion.chunk`` events of one streamed answer, as SSE ``data:`` lines."""

    def __init__(self, model_name: str) -> None:
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model_name}

    def event(self, choices: list[dict], **extra: Any) -> bytes:
        return f"data: {json.dumps({**self.head, 'choices': choices, **extra})}\n\n".encode()

    def delta(self, delta: dict) -> bytes:
        return self.event([{"index": 0, "delta": delta, "finish_reason": None}])

    def last(self, req: ChatRequest, answer, tokenizer) -> bytes:
        choice: dict = {"index": 0, "delta": {}, "finish_reason": answer.finish_reason}
        if req.logprobs:
            choice["logprobs"] = _logprobs(answer, tokenizer)
        return self.event([choice], system_fingerprint=f"rlfleet-{answer.adapter_version or 'base'}",
                          rlfleet=_extension(answer))

    def usage(self, answer) -> bytes:
        return self.event([], usage=_usage(answer))


async def _stream(request: web.Request, req: ChatRequest, answer_with, model_name: str,
                  tokenizer) -> web.StreamResponse:
    """Stream one answer: each piece of text as the responder decodes it, then the closing chunk.

    ``answer_with(on_text)`` runs the responder in a thread; its pieces cross to this loop through a
    queue. A client that goes away mid-answer only stops the writing: the answer still finishes (the
    responder holds one model and the lock), and nothing half-done is left behind.
    """
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[str | None] = asyncio.Queue()
    chunks = _Chunks(model_name)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    gone = False

    async def send(data: bytes) -> None:
        nonlocal gone
        if gone:
            return
        try:
            await resp.write(data)
        except (ConnectionError, RuntimeError):  # the client hung up
            gone = True

    await send(chunks.delta({"role": "assistant", "content": ""}))
    task = asyncio.ensure_future(on_compute_thread_async(functools.partial(
        answer_with, lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text))))
    task.add_done_callback(lambda _t: pieces.put_nowait(None))
    stops = StopFilter(req.stop or [])
    while (piece := await pieces.get()) is not None:
        if text := stops.feed(piece):
            await send(chunks.delta({"content": text}))
    if text := stops.flush():
        await send(chunks.delta({"content": text}))
    try:
        answer = task.result()
    except Exception as exc:  # headers are sent: the error goes as an event, the trace to our log
        log.exception("answer failed")
        error = _error_body(f"the model failed to answer: {exc.__class__.__name__}", "server_error")
        await send(f"data: {json.dumps(error)}\n\n".encode())
    else:
        await send(chunks.last(req, answer, tokenizer))
        if req.stream_options is not None and req.stream_options.include_usage:
            await send(chunks.usage(answer))
    await send(b"data: [DONE]\n\n")
    if not gone:
        await resp.write_eof()
    return resp


@dataclass
class _Job:
    messages: list[dict]
    seed: int | None
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    done: asyncio.Future
    scope: str | None = None
    gone: Callable[[], bool] = lambda: False  # the client hung up while it waited
    stop: list[str] = field(default_factory=list)  # each row of a batch stops on its own strings

    @property
    def settings(self) -> tuple:
        """Requests answered in one batch must share these (the batch has one generation config and
        one adapter)."""
        return self.max_new_tokens, self.temperature, self.top_p, self.scope


class Batcher:
    """Whole (not streamed) answers, batched: the requests that wait while the model answers others,
    and those that arrive within ``window_s`` of the first, are answered together, up to ``max_batch``
    at once, in one :meth:`LocalResponder.answer_many` call per group of equal sampling settings. A
    CPU's cost per generated token is mostly fixed, so sixteen waiting clients are served for a
    fraction of sixteen answers' time; one client alone is answered as before."""

    def __init__(self, responder: Any, lock: asyncio.Lock, max_batch: int = 16, window_s: float = 0.02) -> None:
        self.responder, self.lock, self.max_batch, self.window_s = responder, lock, max_batch, window_s
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()

    async def answer(self, messages: list[dict], seed: int | None, max_new_tokens: int | None,
                     temperature: float | None, top_p: float | None, scope: str | None = None,
                     gone: Callable[[], bool] = lambda: False, stop: list[str] | None = None) -> Any:
        job = _Job(messages, seed, max_new_tokens, temperature, top_p, asyncio.get_running_loop().create_future(),
                   scope, gone, list(stop or []))
        await self.queue.put(job)
        return await job.done

    async def run(self) -> None:
        while True:
            jobs = [await self.queue.get()]
            # Clients that start together reach the server a few milliseconds apart: a short wait lets
            # the burst share one generate instead of its first request going alone.
            await asyncio.sleep(self.window_s)
            while len(jobs) < self.max_batch and not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.settings, []).append(job)
            for group in groups.values():
                await self._answer(group)

    async def _answer(self, group: list[_Job]) -> None:
        for job in group:  # a client that left while it waited is answered by nobody: not drawn for
            if job.gone() and not job.done.done():
                job.done.cancel()
        group = [job for job in group if not job.done.done()]
        if not group:
            return
        first = group[0]
        try:
            async with self.lock:
                if len(group) == 1:
                    answers = [await on_compute_thread_async(functools.partial(
                        self.responder.answer, first.messages, first.seed, first.max_new_tokens,
                        first.temperature, first.top_p, scope=first.scope, stop=first.stop))]
                else:
                    answers = await on_compute_thread_async(functools.partial(
                        self.responder.answer_many, [j.messages for j in group], first.seed,
                        first.max_new_tokens, first.temperature, first.top_p, scope=first.scope,
                        stops=[j.stop for j in group]))
        except Exception as exc:
            for job in group:
                if not job.done.done():
                    job.done.set_exception(exc)
            return
        for job, answer in zip(group, answers, strict=True):
            if not job.done.done():  # a client that went away cancelled its wait
                job.done.set_result(answer)


def _hung_up(request: web.Request) -> bool:
    """The client closed its connection (aiohttp does not cancel a handler for it)."""
    return request.transport is None or request.transport.is_closing()


def make_app(responder, model_name: str, max_batch: int = 16) -> web.Application:
    """The aiohttp app around a :class:`LocalResponder`: it holds one model, so one generate runs at a
    time, streamed answers alone and whole ones batched (:class:`Batcher`)."""
    lock = asyncio.Lock()
    batcher = Batcher(responder, lock, max_batch)

    async def batching(app: web.Application):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "rlfleet"}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(model_name)]})

    async def one_model(request: web.Request) -> web.Response:  # the openai client's models.retrieve
        name = request.match_info["name"]
        try:
            request_scope(name, None, model_name)
        except (LookupError, ValueError) as exc:  # not this model, or a scope that is none
            return _error(404, str(exc.args[0]), "not_found_error")
        return web.json_response(model_card(name))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "model": model_name, "adapter_version": responder.current_version(),
                                  "engine": getattr(responder, "engine", "torch")})

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            req = ChatRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, describe_validation_error(exc, "invalid request"))
        try:
            scope = request_scope(req.model, request.headers.get(SCOPE_HEADER), model_name)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found_error")
        except ValueError as exc:
            return _error(400, str(exc))
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        max_new_tokens = req.max_completion_tokens or req.max_tokens
        try:  # before the request waits its turn: one too long for the model would hold every other one
            await asyncio.to_thread(responder.check_fits, messages)
        except ContextTooLong as exc:
            return _error(400, str(exc), code="context_length_exceeded")
        if req.stream:
            def answer_with(on_text):
                return responder.answer(messages, req.seed, max_new_tokens, req.temperature, req.top_p,
                                        on_text=on_text, scope=scope, stop=req.stop)

            async with lock:
                if _hung_up(request):  # it left while others were answered: nobody to draw for
                    return web.Response(status=499)
                return await _stream(request, req, answer_with, model_name, responder.tokenizer)
        try:
            answer = await batcher.answer(messages, req.seed, max_new_tokens, req.temperature, req.top_p, scope,
                                          gone=lambda: _hung_up(request), stop=req.stop)
        except asyncio.CancelledError:
            if not _hung_up(request):
                raise
            return web.Response(status=499)
        except Exception as exc:  # one line to the caller, the trace to our log
            log.exception("answer failed")
            return _error(500, f"the model failed to answer: {exc.__class__.__name__}", "server_error")
        return web.json_response(completion_body(req, answer, model_name, responder.tokenizer))

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[openai_errors])
    app.cleanup_ctx.append(batching)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", one_model)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


async def serve(responder, model_name: str, host: str, port: int) -> None:
    async with listening(make_app(responder, model_name), host, port) as bound:
        log.info("serving %s on http://%s:%s/v1", model_name, host, bound)
        await until_cancelled()
