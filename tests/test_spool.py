"""The hooks' spool under concurrent use: hooks append while the bridge drains and `status` counts,
each in its own thread here (processes in real life, through the same file lock)."""

from __future__ import annotations

import threading

from rlfleet.bridge import spool


def test_counting_and_draining_side_by_side_never_fail_and_send_each_line_once(tmp_path):
    sent: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def send(_method: str, _path: str, body: dict) -> None:
        sent.append(body["event_id"])

    def forever(action) -> None:
        try:
            while not stop.is_set():
                action()
        except BaseException as exc:  # noqa: BLE001 - any failure of a reader is the finding
            errors.append(exc)

    workers = [threading.Thread(target=forever, args=(lambda: spool.drain(tmp_path, send),)) for _ in range(2)]
    workers += [threading.Thread(target=forever, args=(lambda: spool.pending(tmp_path),)) for _ in range(2)]
    for w in workers:
        w.start()
    ids = [f"e{i}" for i in range(300)]
    for event_id in ids:
        spool.append(tmp_path, "POST", "/v1/ratings", {"value": "good", "event_id": event_id})
    stop.set()
    for w in workers:
        w.join(10)
    assert errors == []
    spool.drain(tmp_path, send)
    assert sorted(sent) == sorted(ids) and spool.pending(tmp_path) == 0
