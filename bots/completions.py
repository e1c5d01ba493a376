"""The bots' responder: any OpenAI-compatible chat-completions server (ours, `rlfleet serve`; or vLLM,
Ollama, LM Studio, llama.cpp), one code path.

`rlfleet serve` adds an ``rlfleet`` object to its reply (adapter version, token ids and raw log-probs
under the answering policy); only then are log-probs kept as the behaviour policy. Another server's
log-probs come from its own tokenizer and sampling settings, which is not the quantity the trainer
computes, so they are dropped and the trainer uses the policy at the start of the run instead.
"""

from __future__ import annotations

import json
import os

import aiohttp

from rlfleet.shared import scopes
from rlfleet.shared.config import ChatSettings, ResponderSettings
from rlfleet.shared.errors import ContextTooLong, ModelUnavailable
from rlfleet.shared.events import finish_reason
from rlfleet.shared.ingress.usecases import Completion
from rlfleet.shared.serve import SCOPE_HEADER

# How servers say a conversation is longer than their model reads: OpenAI's and `rlfleet serve`'s code,
# vLLM's and llama.cpp server's words.
_TOO_LONG_WORDS = ("maximum context length", "exceeds the available context size", "exceed_context_size")


def context_refusal(status: int, body: str) -> str | None:
    """The server's message when its answer ``status``/``body`` refuses a conversation for its length;
    None for any other answer."""
    if status != 400:
        return None
    try:
        data = json.loads(body)
        error = data.get("error", data)  # (older vLLM puts the error's fields at the top)
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        message = str(error.get("message") or "")
        if error.get("code") == "context_length_exceeded" or any(
                w in f"{message} {error.get('type', '')}".lower() for w in _TOO_LONG_WORDS):
            return message[:300] or "the conversation is longer than the model reads at once"
    return None


class ChatCompletions:
    def __init__(self, settings: ResponderSettings, chat: ChatSettings) -> None:
        self.settings = settings
        self.chat = chat
        self.base = settings.url.rstrip("/")
        self._model = settings.model
        key = os.environ.get(settings.api_key_env, "").strip()
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def _json(self, session: aiohttp.ClientSession, method: str, path: str, body: dict | None = None,
                    headers: dict | None = None) -> dict:
        try:
            async with session.request(method, self.base + path, json=body,
                                       headers={**self._headers, **(headers or {})}) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    if (too_long := context_refusal(resp.status, text)) is not None:
                        raise ContextTooLong(too_long)
                    raise ModelUnavailable(f"the responder at {self.base} answered {resp.status}: {text[:200]}")
                return await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise ModelUnavailable(
                f"no responder at {self.base} ({exc.__class__.__name__}); start one with `rlfleet serve` "
                "or set responder.url"
            ) from None

    async def model(self, session: aiohttp.ClientSession) -> str:
        if self._model is None:
            data = await self._json(session, "GET", "/models")
            models = [m.get("id") for m in data.get("data", []) if m.get("id")]
            if not models:
                raise ModelUnavailable(f"the responder at {self.base} lists no models")
            self._model = models[0]
        return self._model

    async def complete(self, messages: list[dict], scope: str | None = None) -> Completion:
        """The responder's answer to ``messages``; ``scope``: the scope key whose adapter answers
        (shared/scopes.py; sent as the ``X-Rlfleet-Scope`` header, which `rlfleet serve` honours and
        other servers ignore)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            body: dict = {
                "model": await self.model(session),
                "messages": messages,
                "max_tokens": self.chat.max_new_tokens,
                "temperature": self.chat.temperature,
                "top_p": self.chat.top_p,
            }
            if self.settings.logprobs:
                body["logprobs"] = True
            scoped = {SCOPE_HEADER: scope} if scope is not None and scope != scopes.SHARED else None
            data = await self._json(session, "POST", "/chat/completions", body, scoped)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ModelUnavailable(f"the responder at {self.base} sent no answer") from None
        ours = data.get("rlfleet") or {}
        ids, lps = ours.get("token_ids"), ours.get("logprobs")
        keep = isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps) and ids
        return Completion(
            text=text.strip(),
            model=str(data.get("model") or body["model"]),
            adapter_version=ours.get("adapter_version"),
            token_ids=ids if keep else None,
            logprobs=lps if keep else None,
            messages=ours.get("messages") if isinstance(ours.get("messages"), list) else None,
            ours="rlfleet" in data,
            finish_reason=finish_reason(choice.get("finish_reason")),
        )
