"""What a job, or an event's answer, tells whoever enqueued it.

On the wire (an RQ job's return value, an event's answer in Redis) it is the JSON object
``{"ok": bool, "message": str, ...}``: ``ok`` says whether it did what was asked, ``message`` says so
to a person, and each job may add fields of its own (``version``, ``training``, ``applied``,
``status``...), which readers take with ``.get``. Bad input and refusals are answers with ``ok`` false,
not exceptions: RQ would retry an exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class JobResult:
    ok: bool
    message: str
    extra: Mapping[str, Any] = field(default_factory=dict)  # the job's own fields, in wire order

    @classmethod
    def done(cls, message: str, **extra: Any) -> JobResult:
        return cls(True, message, extra)

    @classmethod
    def failed(cls, message: str, **extra: Any) -> JobResult:
        return cls(False, message, extra)

    def with_extra(self, **extra: Any) -> JobResult:
        """The same answer with more fields (a field named again takes the new value)."""
        return replace(self, extra={**self.extra, **extra})

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "message": self.message, **self.extra}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobResult:
        extra = {k: v for k, v in d.items() if k not in ("ok", "message")}
        return cls(bool(d.get("ok")), str(d.get("message", "")), extra)
