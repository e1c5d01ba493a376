"""The bridge's request bodies (what gateways and hooks send) and its OpenAPI description, built from them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from rlfleet.shared.events import (
    MAX_COMMENT_CHARS,
    MAX_MESSAGES,
    Ident,
    Message,
    check_command_args,
    known_finish_word,
)

AgentSource = Literal["bridge", "claude-code", "codex"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event_id: Ident | None = Field(None, description="idempotency key: a repeat is ignored (default: a new UUID)")
    source: AgentSource = "bridge"
    actor: Ident | None = Field(None, description="who acts (default: the signing key's id)")


class CaptureIn(_Body):
    conversation: Ident = Field("default", description="session, channel or thread id")
    message_ref: Ident | None = Field(None, description="your id of the answer, to rate it by later")
    owner: Ident | None = Field(None, description="whose answer it is (default: the actor)")
    prompt: list[Message] | str = Field(description="the conversation so far, or one user message")
    response: str = Field(description="the answer to capture")
    model: Ident = Field("external", description="what produced the answer")
    capture_id: Ident | None = None
    finish_reason: Annotated[str, AfterValidator(known_finish_word)] | None = Field(
        None, description="how the answer ended, in its API's word: `stop`, `length` (OpenAI's finish_reason), "
        "`end_turn`, `max_tokens` (Anthropic's stop_reason)…; one cut off by a length cap trains without an "
        "end token")


def _no_bool_or_float(v: object) -> object:
    """JSON's ``true`` and ``1.0`` are ``1`` to a Literal: a thumb is the word or the integer, as the
    schema says, and a sender's ``false`` or ``0.5`` would otherwise be refused while ``true`` passed."""
    if isinstance(v, (bool, float)):
        raise ValueError(f'a thumb is "good", "bad", 1 or -1 (or null), not {v!r}')
    return v


class RatingIn(_Body):
    target: Ident = Field("last", description="a message_ref or capture id, or `last` (your latest in conversation; "
                          "with no value, the answer of your latest rating there)")
    conversation: Ident | None = None
    value: Annotated[Literal["good", "bad", 1, -1] | None, BeforeValidator(_no_bool_or_float)] = Field(
        description="null: keep your rating of the answer and give it `comment` as its reason (`/rl why`)")
    comment: str | None = Field(None, max_length=MAX_COMMENT_CHARS)
    stars: StrictInt | None = Field(None, ge=1, le=5, description="1-5 stars beside the thumb (4-5 good, 1-3 bad); "
                              "with no value they set it, with one they must agree with it")


class UndoIn(_Body):
    target: Ident | None = Field(None, description="undo your rating of this answer (default: your latest)")
    conversation: Ident | None = None


class CommandIn(_Body):
    name: Literal["train", "rollback", "promote", "reset", "pause", "resume"]
    args: dict[str, str | int | bool | None] = Field(
        default_factory=dict, max_length=16,
        description="rollback: version, promote: version and force, reset: purge_ratings; any: scope")

    @model_validator(mode="after")
    def _known_args(self) -> CommandIn:
        check_command_args(self.name, self.args)
        return self


class Accepted(BaseModel):
    ok: bool = True
    event_id: str
    capture_id: str | None = None
    result: dict | None = Field(None, description="the worker's answer, when ?wait=SECONDS was given and it came")


class Problem(BaseModel):
    error: str


ROUTES: list[tuple[str, str, type[BaseModel] | None, str, bool]] = [
    # method, path, body, summary, admin
    ("post", "/v1/captures", CaptureIn, "Record an answer so it can be rated", False),
    ("post", "/v1/ratings", RatingIn, "Rate an answer by message ref, capture id or `last`", False),
    ("post", "/v1/undo", UndoIn, "Take back your latest rating (or your rating of `target`)", False),
    ("get", "/v1/status", None, "Model, ratings, adapter versions, training (a non-admin key: its own people's scopes "
     "only)", False),
    ("post", "/v1/commands", CommandIn, "train, rollback, promote, reset, pause, resume (admin keys only)", True),
]
MAX_PROMPT_MESSAGES = MAX_MESSAGES


def openapi() -> dict:
    schemas = {m.__name__: m.model_json_schema(ref_template="#/components/schemas/{model}")
               for m in (CaptureIn, RatingIn, UndoIn, CommandIn, Accepted, Problem)}
    defs: dict = {}
    for schema in schemas.values():
        defs.update(schema.pop("$defs", {}))
    errors = {str(code): {"description": why, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Problem"}}}}
        for code, why in ((401, "missing, bad, stale or replayed signature"), (403, "not an admin key"),
                          (413, "body too large"), (422, "invalid body"), (429, "rate limit"))}
    paths: dict = {"/health": {"get": {"summary": "Liveness (no auth)", "security": [],
                                       "responses": {"200": {"description": "up"}}}}}
    for method, path, body, summary, _admin in ROUTES:
        op: dict = {"summary": summary, "parameters": [{"name": "wait", "in": "query", "required": False,
                    "schema": {"type": "number", "maximum": 10},
                    "description": "seconds to wait for the worker's answer"}] if body else [],
                    "responses": {"202" if body else "200": {"description": "accepted" if body else "status",
                                  "content": {"application/json": {"schema": {
                                      "$ref": "#/components/schemas/Accepted"} if body else {"type": "object"}}}},
                                  **errors}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "$ref": f"#/components/schemas/{body.__name__}"}}}}
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rlfleet bridge", "version": "1",
                 "description": "Signed with HMAC-SHA256: X-Rlfleet-Timestamp (unix s), X-Rlfleet-Key (default "
                                "`local`), X-Rlfleet-Signature: sha256=hex(HMAC(secret, timestamp \\n METHOD \\n "
                                "path with its query string \\n + raw body)); a key that is not an admin names "
                                "only its own actors (`alice` signed by key `gw` acts as `gw:alice`)."},
        "paths": paths,
        "components": {"schemas": {**schemas, **defs}, "securitySchemes": {"hmac": {
            "type": "apiKey", "in": "header", "name": "X-Rlfleet-Signature"}}},
        "security": [{"hmac": []}],
    }
