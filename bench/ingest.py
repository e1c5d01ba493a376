"""How many ratings per second the queue and the workers take, and how long one takes to be a row.

    python -m bench.ingest [--ratings 10000] [--workers 1,2,4] [--rate 500] [--redis URL|embedded]
                           [--producers 1] [--postgres ADMIN_URL] [--json] [--no-record]

Through the real path: each rating is a typed event handed to the inbox on Redis (`enqueue_event`,
as a bot or the bridge does), applied by real `rlfleet worker --queue events` processes into the
database (SQLite in a temporary data dir, or with `--postgres` a fresh PostgreSQL database per case).
Latency is from the event's creation (its ``ts``) to its answer being visible, which the drain
writes after the batch's commit: an upper bound of "to the committed row". Beside it, the ceilings:
a no-op RQ job through the same workers (what one RQ job per rating, the earlier design, could reach
at best) and raw Redis round trips.
With ``--redis embedded`` the queue is the data dir's own embedded server, as a user without
``REDIS_URL`` runs it: append-only with ``appendfsync always``, so every acknowledgement waits for an
fsync (the ceilings are left out there: they need a server that outlives one case).
"sent /s" is how fast the producers handed the events over: one by default, each waiting for its
acknowledgement before it sends the next (so with the fsync one producer sends at most one event per
fsync; Redis groups the fsyncs of concurrent producers, which ``--producers N`` shows).
The p99 of each part of that latency is printed beside it, so what bounds it shows: "ack" (the
producer's hand-over, until Redis acknowledged it), "wait" (from the acknowledgement until a drain
took the event: the doorbell, and the batch before it) and "apply" (from the take until the answer,
the batch's transaction and commit).
Prints a table; asserts nothing.

One drain applies the inbox at a time (so one user's events keep their order), so more workers do
not raise intake: the rows for 2 and 4 workers show that they do not lower it either.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from rq import Queue
from sqlalchemy import func, select

from rlfleet.shared import inbox
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.queue import EVENTS_QUEUE, enqueue_event, open_queue
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.store import Store

from .record import markdown_table, output_options, parser, publish, stop_processes

EMBEDDED = "embedded"  # --redis: the data dir's own server, fsync before every acknowledgement


def noop() -> None:
    """The ceiling's job: RQ's own cost per job, nothing of ours."""


def _workers(n: int, home: Path, env: dict) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "rlfleet.worker", "--queue", "events"], env=env,
                             stdout=subprocess.DEVNULL, stderr=open(home / "worker.log", "ab")) for _ in range(n)]


def _wait_rows(store: Store, n: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with store.session() as s:
            if (s.scalar(select(func.count()).select_from(RatingRow)) or 0) >= n:
                return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {n} ratings stored after {timeout} s")


PARTS = ("ack", "wait", "apply")


def _latencies(conn: redis.Redis, sent: dict[str, tuple[float, float]], timeout: float = 10.0
               ) -> dict[str, list[float]]:
    """Milliseconds per answered event: "total" (created to answered) and each of ``PARTS``. A batch's
    answers are written just after its commit, so the last ones may come a moment after the rows."""
    ids = list(sent)
    at: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout
    while True:
        missing = [e for e in ids if e not in at]
        for i in range(0, len(missing), 1000):
            at.update(inbox.stamps(conn, missing[i:i + 1000]))
        if len(at) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out: dict[str, list[float]] = {"total": [], **{p: [] for p in PARTS}}
    for e in ids:
        if e not in at:
            continue
        (created, acked), taken, answered = sent[e], at[e]["taken_at"], at[e]["answered_at"]
        for part, (a, b) in (("total", (created, answered)), ("ack", (created, acked)), ("wait", (acked, taken)),
                             ("apply", (taken, answered))):
            out[part].append((b - a) * 1000)
    return out


@contextmanager
def fresh_database(postgres_admin: str | None, prefix: str = "rlfleet_ingest_") -> Iterator[str | None]:
    """A new empty PostgreSQL database for one case (dropped after it), or None: SQLite in the data dir.
    The tests' databases come from here too (their own ``prefix``)."""
    if postgres_admin is None:
        yield None
        return
    import sqlalchemy as sa

    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(postgres_admin, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = postgres_admin.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        from rlfleet.shared import store as store_mod

        store_mod.forget(url)
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_case(workers: int, ratings: int, rate: float | None, redis_url: str, postgres_admin: str | None = None,
             producers: int = 1, home: Path | None = None) -> dict:
    """One configuration in a fresh data dir (and a fresh PostgreSQL database with ``postgres_admin``);
    ``rate`` None = as fast as the producers can enqueue. Without ``home`` the data dir is a temporary
    folder, removed at the end."""
    with fresh_database(postgres_admin) as db_url:
        if home is not None:
            return _run_case(workers, ratings, rate, redis_url, db_url, producers, home)
        with tempfile.TemporaryDirectory(prefix="rlfleet-ingest-", ignore_cleanup_errors=True) as tmp:
            return _run_case(workers, ratings, rate, redis_url, db_url, producers, Path(tmp))


def _produce(handle, captures: list[Capture], first: int, step: int, rate: float | None, t0: float,
             sent: dict[str, tuple[float, float]]) -> None:
    """One producer: every ``step``-th rating from ``first``, each on the shared schedule of ``rate``."""
    for i in range(first, len(captures), step):
        if rate:
            ahead = t0 + i / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        ev = Rating(target=captures[i].capture_id, value=1 if i % 2 else -1)
        enqueue_event(handle, ev)
        sent[ev.event_id] = (ev.ts.timestamp(), time.time())


def _run_case(workers: int, ratings: int, rate: float | None, redis_url: str, db_url: str | None,
              producers: int, home: Path) -> dict:
    where = {"RLFLEET_HOME": str(home), "RLFLEET_MODEL": "bench"}
    for var, value in (("REDIS_URL", None if redis_url == EMBEDDED else redis_url), ("DATABASE_URL", db_url)):
        if value:
            where[var] = value
        else:
            os.environ.pop(var, None)
    env = {**os.environ, **where}
    os.environ.update(where)
    cfg = load_config(home)
    cfg.train.threshold = 100_000  # no training runs in the way
    cfg.save()
    handle = open_queue(cfg)
    if redis_url != EMBEDDED:  # a fresh embedded server is empty already (and holds our lease)
        handle.redis.flushdb()
    store = Store(cfg.db_url)
    captures = [Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")], response=f"a{i}",
                        model="bench") for i in range(ratings)]
    for i in range(0, len(captures), 500):  # the answers exist already: what is measured is rating intake
        store.apply_many(captures[i:i + 500], "bench")
    procs = _workers(workers, home, env)
    time.sleep(2.0)  # let them connect
    sent: dict[str, tuple[float, float]] = {}
    try:
        t0 = time.monotonic()
        threads = [threading.Thread(target=_produce, args=(handle, captures, k, producers, rate, t0, sent))
                   for k in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_sent = time.monotonic()
        t_end = _wait_rows(store, ratings, timeout=max(120, ratings / 20))
        lat = _latencies(handle.redis, sent)
    finally:
        stop_processes(procs, 10)
        handle.close()
    return {"workers": workers, "producers": producers, "ratings": ratings, "offered_rate": rate or "max",
            "sent_per_s": ratings / (t_sent - t0), "ratings_per_s": ratings / (t_end - t0),
            "p50_ms": statistics.median(lat["total"]), "p99_ms": _p99(lat["total"]), "answered": len(lat["total"]),
            **{f"p99_{part}_ms": _p99(lat[part]) for part in PARTS}}


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


_NOOP_WORKER = (
    "import sys; from redis import Redis; from rq import Queue, SimpleWorker; "
    "c = Redis.from_url(sys.argv[1]); SimpleWorker([Queue(sys.argv[2], connection=c)], connection=c)"
    ".work(burst=True, logging_level='WARNING')"
)


def ceiling(workers: int, jobs: int, redis_url: str) -> dict:
    """RQ's own cost per job (SimpleWorker, as ours) with nothing of ours in the job, and raw Redis."""
    conn = redis.Redis.from_url(redis_url)
    conn.flushdb()
    t = time.perf_counter()
    for _ in range(2000):
        conn.ping()
    ping_us = (time.perf_counter() - t) / 2000 * 1e6
    q = Queue(EVENTS_QUEUE, connection=conn)
    for _ in range(jobs):
        q.enqueue("bench.ingest.noop", result_ttl=0)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _NOOP_WORKER, redis_url, EVENTS_QUEUE], env=env)
             for _ in range(workers)]
    for p in procs:
        p.wait(600)
    return {"workers": workers, "noop_jobs_per_s": jobs / (time.perf_counter() - t), "redis_ping_us": ping_us}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = parser("bench.ingest", __doc__)
    ap.add_argument("--ratings", type=int, default=10000, help="ratings in each as-fast-as-possible run")
    ap.add_argument("--workers", default="1,2,4", help="comma list of event-worker counts")
    ap.add_argument("--rate", type=float, default=500.0, help="the fixed offered rate for the latency row")
    ap.add_argument("--producers", type=int, default=1,
                    help="senders in the full-speed rows, each acknowledged in turn (bots, the bridge: one each)")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/10",
                    help=f"a Redis DB this may flush, or {EMBEDDED!r}: each case's own embedded server")
    ap.add_argument("--postgres", metavar="ADMIN_URL", default=None,
                    help="store in PostgreSQL instead of SQLite: a URL allowed to create and drop a database "
                         "per case (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres)")
    output_options(ap)
    args = ap.parse_args(argv)
    rows = []
    for w in (int(x) for x in args.workers.split(",")):
        rows.append({**run_case(w, args.ratings, None, args.redis, args.postgres, args.producers),
                     **(ceiling(w, min(args.ratings, 2000), args.redis) if args.redis != EMBEDDED else {})})
        rows.append(run_case(w, min(args.ratings, int(args.rate * 10)), args.rate, args.redis, args.postgres))

    def ceil(r: dict, key: str) -> str:
        return f"{r[key]:.0f}" if key in r else ""

    table = markdown_table(
        ["workers", "producers", "ratings", "offered /s", "sent /s", "stored /s", "p50 ms", "p99 ms",
         "p99 ack / wait / apply ms", "no-op RQ jobs/s", "Redis PING µs"],
        [[r["workers"], r["producers"], r["ratings"], r["offered_rate"], f"{r['sent_per_s']:.0f}",
          f"{r['ratings_per_s']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
          " / ".join(f"{r[f'p99_{part}_ms']:.1f}" for part in PARTS), ceil(r, "noop_jobs_per_s"),
          ceil(r, "redis_ping_us")]
         for r in rows])
    redis_kind = "embedded Redis (appendfsync always)" if args.redis == EMBEDDED else "external Redis (--redis)"
    publish({"rows": rows, "database": "postgresql" if args.postgres else "sqlite", "redis": args.redis}, table,
            args, f"`bench.ingest` · {'PostgreSQL' if args.postgres else 'SQLite'} · {redis_kind}")
    return rows


if __name__ == "__main__":
    main()
