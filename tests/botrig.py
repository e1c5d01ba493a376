"""What the bot tests share: a data dir wired to the real test Redis, the real store, a BotCore for one
platform answering through a fake OpenAI-compatible responder, and the real worker to apply events."""

from __future__ import annotations

import asyncio
import faulthandler
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

from botfakes import FakeOpenAI
from rq import Queue, SimpleWorker
from rq.timeouts import TimerDeathPenalty
from sqlalchemy import select

from rlfleet.bots.core import BotCore
from rlfleet.shared.config import load_config
from rlfleet.shared.queue import EVENTS_QUEUE, open_queue
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store
from rlfleet.worker.runner import run_worker

OWNER, STRANGER, RATER, ADMIN = "1001", "1002", "1003", "1004"


class BotRig:
    def __init__(self, cfg, handle, store: Store, core: BotCore, llm: FakeOpenAI) -> None:
        self.cfg, self.handle, self.store, self.core, self.llm = cfg, handle, store, core, llm

    def work(self) -> None:
        """Run the real worker over the events queue until it is empty."""
        run_worker(self.cfg, "events", burst=True, handle=self.handle)

    async def drain(self, settle: float = 0.2) -> None:
        await asyncio.sleep(settle)  # let the listeners enqueue
        self.work()

    async def until(self, check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
        """Work the queue until ``check()`` is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.work()
            await asyncio.sleep(0.05)

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until a LiveWorker has applied every job enqueued so far (each one's status says so;
        the queue's length alone has a gap between dequeue and start)."""
        deadline = time.monotonic() + timeout
        while True:
            conn = self.handle.redis
            busy = [k for k in conn.scan_iter("rq:job:*") if k.count(b":") == 2
                    and conn.hget(k, "origin") == EVENTS_QUEUE.encode()
                    and conn.hget(k, "status") in (b"queued", b"started", b"scheduled")]
            if not busy and not self.handle.waiting_events():
                return
            if time.monotonic() > deadline:
                queued = set(Queue(EVENTS_QUEUE, connection=conn).job_ids)
                said = [(k.decode(), (conn.hget(k, "status") or b"").decode(),
                         (conn.hget(k, "exc_info") or b"")[-600:].decode(errors="replace"),
                         f"in the queue: {k.decode().removeprefix('rq:job:') in queued}") for k in busy]
                faulthandler.dump_traceback(sys.stderr, all_threads=True)  # where the worker thread is
                raise AssertionError(f"the worker did not finish {len(busy)} job(s): {said}")
            await asyncio.sleep(0.02)

    def ratings(self) -> list[tuple[str, int, str]]:
        with self.store.session() as s:
            return [(r.actor, r.value, r.state) for r in s.scalars(select(RatingRow).order_by(RatingRow.id))]

    def captures(self) -> list[CaptureRow]:
        with self.store.session() as s:
            rows = list(s.scalars(select(CaptureRow).order_by(CaptureRow.created)))
            s.expunge_all()
            return rows

    def queued(self) -> int:
        return self.handle.waiting_events()


class _ThreadWorker(SimpleWorker):
    death_penalty_class = TimerDeathPenalty  # job timeouts by timer: SIGALRM is the main thread's

    def _install_signal_handlers(self) -> None:  # only the main thread may own signals; the test stops us
        pass


class LiveWorker:
    """The real RQ worker over the events queue, in a thread, so a bot's reply can wait for its result
    the way it does beside `rlfleet up`'s worker process."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        queue = Queue(EVENTS_QUEUE, connection=self.handle.redis)
        while not self.stop.is_set():
            if queue.count:
                _ThreadWorker([queue], connection=self.handle.redis).work(burst=True, logging_level="WARNING")
            self.stop.wait(0.01)

    def __enter__(self) -> LiveWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


@asynccontextmanager
async def bot_rig(platform: str, **settings: Any):
    async with FakeOpenAI() as llm:
        cfg = load_config()
        cfg.responder.url = f"{llm.url}/v1"
        for k, v in {"raters": [RATER], "admins": [ADMIN], **settings}.items():
            setattr(cfg.bots.get(platform), k, v)
        cfg.save()  # the worker reads the allowlists from config.toml, as in production
        handle = open_queue(cfg)
        store = Store(cfg.db_url)
        core = BotCore(platform, cfg, handle, store, wait_s=10.0)  # type: ignore[arg-type]
        try:
            yield BotRig(cfg, handle, store, core, llm)
        finally:
            handle.close()


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


@contextmanager
def held(rig: AbstractAsyncContextManager) -> Iterator[tuple[Any, Callable[[Awaitable], Any]]]:
    """Enter ``rig`` on an event loop of its own and keep it open across many synchronous steps (the
    cases of a hypothesis test): yields the rig and ``step(coro)``, which runs one coroutine on that loop.
    Between steps the loop is idle and the bot's own tasks wait; they carry on in the next step."""
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()

    def step(coro: Awaitable) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, 60))

    try:
        yield step(stack.enter_async_context(rig)), step
    finally:
        try:
            step(stack.aclose())
        finally:
            loop.close()
