"""When the next training run starts by itself (shared/runs.ratings_until_run): the rule the worker
applies and bench/time_to_adapter plans with."""

from __future__ import annotations

from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.runs import INTERRUPTED_IN_A_ROW, STOPPED_ON_REQUEST, fail_interrupted, ratings_until_run
from rlfleet.shared.store import Store


def _rate(store: Store, n: int, start: int) -> None:
    caps = [Capture(capture_id=f"c{i}", prompt=[Message(role="user", content="q")], response="a", model="m")
            for i in range(start, start + n)]
    store.apply_many(caps, "m")
    store.apply_many([Rating(target=c.capture_id, value=1) for c in caps], "m")


def test_threshold_then_half_a_threshold_after_a_refusal_and_at_once_after_an_interruption(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/db.sqlite")
    assert ratings_until_run(store, "m", 8) == 8
    _rate(store, 5, 0)
    assert ratings_until_run(store, "m", 8) == 3
    _rate(store, 3, 5)
    assert ratings_until_run(store, "m", 8) == 0
    run = store.create_run("m")
    store.start_run(run, None)
    store.fail_run(run, "rejected by the gate", state="rejected")  # its 8 ratings stay pending
    assert ratings_until_run(store, "m", 8) == 4  # half a threshold of new ones
    _rate(store, 4, 8)
    assert ratings_until_run(store, "m", 8) == 0
    for i in range(INTERRUPTED_IN_A_ROW):
        run = store.create_run("m")
        store.start_run(run, None)
        store.fail_run(run, "interrupted: the training worker stopped during the run")
        expected = 0 if i + 1 < INTERRUPTED_IN_A_ROW else 4  # retried at once, until the streak is long
        assert ratings_until_run(store, "m", 8) == expected, i


def test_a_users_stops_never_count_toward_the_interrupted_streak(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/db.sqlite")
    _rate(store, 8, 0)

    def interrupted(why: str) -> str:
        run = store.create_run("m")
        store.start_run(run, None)
        fail_interrupted(store, "m", run, why)
        return store.get_run(run).error

    for _ in range(INTERRUPTED_IN_A_ROW + 1):  # more stops in a row than crashes are allowed
        said = interrupted(f"{STOPPED_ON_REQUEST}; it runs again on the next start")
        assert "not retried" not in said
        assert ratings_until_run(store, "m", 8) == 0  # runs again at once
    for i in range(INTERRUPTED_IN_A_ROW):  # the crashes around them still make a streak
        said = interrupted("the training worker stopped during the run")
        interrupted(f"{STOPPED_ON_REQUEST}; it runs again on the next start")
        assert ("3 runs in a row: not retried" in said) == (i + 1 == INTERRUPTED_IN_A_ROW), (i, said)
