"""``rlfleet chat``: the terminal as a platform. It answers with the local model, captures each answer
with its behaviour log-probs, and turns the key pressed after it into a rating event on the queue.

Like every front end it only translates: the ingress use cases (`rlfleet.shared.ingress`) make the
events, as the local user of the data dir, and the worker decides what a rating does.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from rlfleet.shared.config import Config
from rlfleet.shared.errors import ContextTooLong, RlfleetError
from rlfleet.shared.events import describe_validation_error
from rlfleet.shared.ingress.grammar import parse_rl
from rlfleet.shared.ingress.reasons import OTHER, REASONS, menu, reason_for
from rlfleet.shared.ingress.usecases import Completion, Send, UseCases, Value
from rlfleet.shared.models import resolve_model
from rlfleet.shared.permissions import LOCAL_ACTOR, Actor, PermissionTable
from rlfleet.shared.queue import QueueHandle, open_queue
from rlfleet.shared.runs import was_interrupted

from .training_news import TrainingNews

readline: ModuleType | None
try:  # line editing, and the typed text a line from the background is drawn above
    import readline
except ImportError:  # not on every platform: lines are then printed as they come
    readline = None

QUIT = ("/quit", "/exit", "/q")
HISTORY_TURNS = 4  # earlier turns kept as context: enough for follow-ups, short enough for a small model
HELP = escape(
    "type a message and press enter · after each answer: [1] good  [2] bad  [c] comment  [enter] skip\n"
    "commands: /rl good|bad [comment] · /rl undo · /rl status · /rl train · /rl rollback [v] · /rl pause|resume"
    " · /new · /quit"
)
console = Console(highlight=False, soft_wrap=True)
ME = Actor("cli", LOCAL_ACTOR)  # the terminal's user: the owner of the data dir

# Sends an event and returns the worker's answer; `rlfleet chat` passes the CLI's, which works the queue
# right here when no events worker runs (`--no-worker`).
Dispatch = Callable[[QueueHandle, Config, Any], dict]


class Workers(Protocol):
    """The background workers the chat runs beside it (`rlfleet chat` passes its fleet)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class ChatState:
    conversation: str
    history: list[dict]
    screen: Screen
    news: TrainingNews
    cases: UseCases
    dispatch: Dispatch
    last_capture: str | None = None


class Screen:
    """Where the chat writes. Lines that arrive while the user types (training news) go above the prompt,
    and what was typed so far is drawn again under them: readline keeps the text, so the line the user
    sends is the one they typed. The progress line is replaced in place while it is the last line."""

    def __init__(self, live: bool) -> None:
        self.live = live and readline is not None  # a terminal: redraw the prompt; else plain lines
        self._lock = threading.Lock()
        self._prompt: str | None = None
        self._progress: str | None = None  # the progress line right above the prompt, if any
        self._said: str | None = None  # the last progress line shown (not live: printed once per change)

    def read(self, prompt: str) -> str | None:
        with self._lock:
            self._prompt, self._progress = prompt, None
        try:
            return input(prompt)
        except EOFError:
            return None
        finally:
            with self._lock:
                self._prompt = None

    def say(self, text: str) -> None:
        with self._lock:
            self._above_prompt(text, replace=self._progress is not None)
            self._progress = None

    def progress(self, line: str | None) -> None:
        with self._lock:
            if line is None or self._prompt is None or line in (self._progress, None if self.live else self._said):
                return
            self._above_prompt(f"[cyan]⟳ {escape(line)}[/]", replace=self._progress is not None)
            self._progress = self._said = line

    def _above_prompt(self, text: str, replace: bool) -> None:
        if not self.live or self._prompt is None or readline is None:  # live implies readline
            console.print(text)
            return
        typed = readline.get_line_buffer()
        sys.stdout.write("\r\x1b[2K" + ("\x1b[1A\x1b[2K" if replace else ""))
        sys.stdout.flush()
        console.print(text)
        sys.stdout.write(self._prompt + typed)
        sys.stdout.flush()


def _watch_training(news: TrainingNews, screen: Screen, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            update = news.poll()
        except Exception:  # noqa: BLE001 - Redis or the database away for a moment: the chat goes on
            continue
        for msg in update.ended:
            screen.say(f"[{'green' if msg.startswith('✓') else 'yellow'}]{escape(msg)}[/]")
        screen.progress(update.progress)


def _carry_out(state: ChatState, cfg: Config, handle: QueueHandle, outcome) -> None:
    """Send the event a use case made and say the worker's answer (or say its refusal)."""
    if isinstance(outcome, Send):
        _say(state.dispatch(handle, cfg, outcome.event), state)
    elif outcome is not None:
        console.print(f"[red]{escape(outcome.text)}[/]")


def chat_loop(cfg: Config, handle: QueueHandle, responder, slug: str, dispatch: Dispatch,
              screen: Screen | None = None) -> None:
    from rlfleet.shared.store import Store

    screen = screen or Screen(live=sys.stdin.isatty() and sys.stdout.isatty())
    news = TrainingNews(Store(cfg.db_url), handle.redis, slug, cfg.train.threshold)
    cases = UseCases(PermissionTable.for_config(cfg), cfg.model, handle)
    state = ChatState(conversation=f"chat-{uuid.uuid4().hex[:8]}", history=[], screen=screen, news=news,
                      cases=cases, dispatch=dispatch)
    active = responder.active_version
    console.print(f"[bold]rlfleet chat[/] · {cfg.model} · " + (
        f"adapter {active}" if active else "base model (no adapter yet)"))
    console.print(f"[dim]{HELP}[/]")
    last = news.store.latest_run(slug)
    if last is not None and last.state in ("failed", "rejected"):  # how the last run went is news too
        console.print(f"[yellow]{escape(news.ended_message(last))}[/]")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_training, args=(news, screen, stop), name="chat-training-news",
                               daemon=True)
    watcher.start()
    try:
        _converse(cfg, handle, responder, state)
    finally:
        stop.set()
        watcher.join(timeout=5)


def _converse(cfg: Config, handle: QueueHandle, responder, state: ChatState) -> None:
    screen = state.screen
    typed: str | None = None  # a chat command typed at the rating prompt, carried out as if typed here
    while True:
        text = typed if typed is not None else screen.read("you> ")
        typed = None
        if text is None or text.strip() in QUIT:
            break
        text = text.strip()
        if not text:
            continue
        if text == "/new":
            state.history.clear()
            console.print("[dim]new conversation[/]")
            continue
        if text.startswith("/rl"):
            _command(text, state, cfg, handle)
            continue
        if text.startswith("/"):
            console.print(f"[red]unknown command {text.split()[0]}[/] · {HELP}")
            continue
        switched = responder.refresh()
        if switched:
            console.print(f"[green]✓ now answering with adapter {switched}[/]")
        messages = state.history[-2 * HISTORY_TURNS:] + [{"role": "user", "content": text}]
        try:
            with console.status("thinking…"):
                messages = responder.fit_history(messages)
                answer = responder.answer(messages, scope=cfg.scope_key_of(ME.source, ME.id, state.conversation))
        except ContextTooLong as exc:  # the message is not kept: the next one would be refused too
            console.print(f"[red]{escape(str(exc))}[/]")
            continue
        console.print(f"[bold]ai>[/] {escape(answer.text)}")
        state.history = messages + [{"role": "assistant", "content": answer.text}]
        if not answer.text.strip():
            console.print("[dim](empty answer: nothing to rate)[/]")
            continue
        try:
            cap = state.cases.capture_event(ME, state.conversation, messages,
                                            Completion.ours_from(answer, cfg.model))
        except ValueError as exc:  # an answer the event contract refuses (a NUL byte, say): not rateable
            reason = (describe_validation_error(exc, "not captured") if isinstance(exc, ValidationError)
                      else f"not captured: {exc}")
            console.print(f"[red]{escape(reason)}; left out of the conversation[/]")
            state.history = state.history[:-2]  # kept, it would make every later capture refused too
            continue
        result = state.dispatch(handle, cfg, cap)
        if not result.get("ok"):
            console.print(f"[red]not captured: {result.get('message')}[/]")
            continue
        state.last_capture = cap.capture_id
        typed = _ask_rating(state, cfg, handle)


def _ask_rating(state: ChatState, cfg: Config, handle: QueueHandle) -> str | None:
    """Ask for a key that rates the last answer; a chat command typed instead (``/quit``, ``/new``) skips
    the rating and is returned for the chat to carry out."""
    comment: str | None = None
    while True:
        key = state.screen.read("[1] good  [2] bad  [c] comment  [enter] skip > ")
        if key is None:
            return None
        if key.strip().startswith("/rl"):  # `/rl bad too long` works here as at the chat prompt
            _command(key.strip(), state, cfg, handle)
            return None
        if key.strip() in (*QUIT, "/new"):
            return key.strip()
        key = key.strip().lower()
        if key == "":
            return None
        if key == "c":
            comment = state.screen.read("comment> ") or None
            continue
        if key in ("1", "2", "g", "b", "good", "bad"):
            value: Value = 1 if key in ("1", "g", "good") else -1
            if value < 0 and comment is None:
                comment = _ask_reason(state)
            _rate(state, cfg, handle, value, comment, target=state.last_capture)
            return None
        console.print("[dim]press 1, 2, c, or enter (or type /rl good, /rl bad \\[why])[/]")


def _ask_reason(state: ChatState) -> str | None:
    """Why a 👎, in one key: one of the shared reasons, ``o`` and your own words, or enter for none."""
    while True:
        key = state.screen.read(f"why? {menu()}  [enter] skip > ")
        if key is None or not key.strip():
            return None
        if key.strip().lower() in ("o", OTHER):
            return state.screen.read("why> ") or None
        reason = reason_for(key)
        if reason is not None:
            return reason
        console.print(f"[dim]press 1-{len(REASONS)}, o, or enter[/]")


def _rate(state: ChatState, cfg: Config, handle: QueueHandle, value: Value, comment: str | None,
          target: str | None, stars: int | None = None) -> None:
    if target is None:
        console.print("[yellow]nothing of yours to rate here yet[/]")
        return
    _carry_out(state, cfg, handle, state.cases.rate(ME, state.conversation, value, comment, target=target,
                                                    stars=stars))


def _say(result: dict, state: ChatState) -> None:
    if result.get("ok"):
        msg = result.get("message", "ok")
        console.print(f"[dim]{escape(msg)}[/]")
        note = state.news.about_trigger(result.get("training"))
        if note:
            console.print(f"[cyan]⟳ {escape(note)}[/]")
    else:
        console.print(f"[red]{escape(str(result.get('message', 'failed')))}[/]")


def _command(text: str, state: ChatState, cfg: Config, handle: QueueHandle) -> None:
    try:
        _run_command(text, state, cfg, handle)
    except ValidationError as exc:
        # Words no event takes (a NUL byte in a comment): said, nothing sent, the chat goes on.
        console.print(f"[red]{escape(describe_validation_error(exc, 'could not record that'))}[/]")


def _run_command(text: str, state: ChatState, cfg: Config, handle: QueueHandle) -> None:
    cmd = parse_rl(text)
    verb = cmd.verb
    if verb == "good" or verb == "bad":
        _rate(state, cfg, handle, 1 if verb == "good" else -1, cmd.arg, state.last_capture, cmd.stars)
    elif verb == "why":
        _carry_out(state, cfg, handle, state.cases.why(ME, state.conversation, cmd.arg))
    elif verb == "undo":
        _carry_out(state, cfg, handle, state.cases.undo(ME))
    elif verb == "status":
        from rlfleet.shared.status import status_dict
        from rlfleet.shared.status_view import render_status

        console.print(render_status(status_dict(cfg, handle)))
    elif cmd.admin:
        args = {"version": cmd.arg} if verb == "rollback" and cmd.arg else {}
        _carry_out(state, cfg, handle, state.cases.command(ME, verb, args))
    else:
        if cmd.unknown:
            console.print(f"[yellow]unknown command {escape(cmd.unknown)!r}[/]")
        console.print(HELP)


def run_chat(cfg: Config, dispatch: Dispatch, workers: Workers | None = None, responder=None) -> None:
    """Open the queue, start the workers, load the model, chat; stop everything on the way out."""
    ref = resolve_model(cfg.model)
    handle = open_queue(cfg)
    try:
        if workers:
            workers.start()
        if responder is None:
            from rlfleet.shared.responder import responder_for

            with console.status(f"loading {cfg.model}…"):
                responder = responder_for(cfg)
        chat_loop(cfg, handle, responder, ref.slug, dispatch)
    except RlfleetError:
        raise
    except KeyboardInterrupt:
        console.print()
    finally:
        if workers:
            _stop_workers(workers, cfg, ref.slug)
        handle.close()
        console.print("[dim]bye[/]")


def _stop_workers(workers: Workers, cfg: Config, slug: str) -> None:
    """Stop the workers; a training run they leave unfinished is said to run again, not lost."""
    from rlfleet.shared.store import Store

    store = Store(cfg.db_url)
    before = store.latest_run(slug)
    with console.status("stopping workers…"):
        workers.stop()
    if before is None or before.state not in ("queued", "running"):
        return
    run = store.get_run(before.id)
    if run is not None and (run.state == "queued" or was_interrupted(run)):
        console.print(f"[yellow]training run {run.id} {'stopped' if run.state == 'failed' else 'waits'}; it runs "
                      "the next time `rlfleet chat` or `rlfleet up` starts[/]")
