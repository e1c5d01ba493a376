"""`rlfleet export ratings` / `rlfleet import ratings`: the rated answers as a JSONL dataset.

One line per rating, in the conversational prompt / completion / label shape TRL's KTOTrainer reads
(``label`` true for good), plus the comment and an ``rlfleet`` object with the provenance needed to
rebuild the very rows (ids, event ids, who, where, when, which adapter answered, the behaviour
log-probs). Import restores what is not in the store now and skips what is (a second import adds
nothing), validates every line, and reports what it skipped and why; training bookkeeping (which
run consumed a rating) stays local and is not exported.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .events import (
    MAX_COMMENT_CHARS,
    MAX_LOGPROBS,
    MAX_TEXT_CHARS,
    FinishReason,
    Ident,
    Message,
    describe_validation_error,
)
from .export import staged
from .ingress.grammar import thumb_of

FORMAT_VERSION: Final = 1
MAX_LINE_BYTES = 8 << 20


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal[1] = FORMAT_VERSION
    rating_event_id: Ident
    actor: Ident
    source: Ident
    value: Literal[1, -1]
    state: Literal["active", "replaced", "undone"]
    train_model: Ident
    rated_at: datetime
    changed_at: datetime
    capture_id: Ident
    capture_event_id: Ident
    capture_source: Ident
    conversation: Ident
    message_ref: Ident | None = None
    owner: Ident
    model: Ident
    adapter_version: Ident | None = None
    captured_at: datetime
    behaviour_logprobs: list[float] | None = Field(None, max_length=MAX_LOGPROBS)
    behaviour_token_ids: list[int] | None = Field(None, max_length=MAX_LOGPROBS)
    finish_reason: FinishReason | None = None


class RatedExample(BaseModel):
    """One JSONL line."""

    model_config = ConfigDict(extra="forbid")
    prompt: list[Message] = Field(min_length=1)
    completion: list[Message] = Field(min_length=1, max_length=1)
    label: bool
    comment: str | None = Field(None, max_length=MAX_COMMENT_CHARS)
    stars: int | None = Field(None, ge=1, le=5)  # beside the thumb, when it was given in stars (`/rl 4`)
    reward: float | None = Field(None, allow_inf_nan=False)  # an environment's, on an agent's step (rlfleet.gym)
    rlfleet: Provenance

    @model_validator(mode="after")
    def _stars_agree(self) -> RatedExample:
        if self.stars is not None and thumb_of(self.stars) != self.rlfleet.value:
            raise ValueError(f"{self.stars} stars disagree with value {self.rlfleet.value} (4-5 good, 1-3 bad)")
        if self.reward is not None and self.rlfleet.source != "gym":
            raise ValueError(f"a reward is an environment's, on an agent's step (source gym), "
                             f"not {self.rlfleet.source}'s")
        return self

    @property
    def response(self) -> str:
        return self.completion[0].content


@dataclass
class ImportReport:
    imported: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    errors: list[str] = field(default_factory=list)  # the first few bad lines, "line N: why"

    def as_dict(self) -> dict:
        return {"imported": self.imported, "skipped": dict(self.skipped), "errors": self.errors}


def to_example(rating, capture) -> RatedExample:
    """A stored (RatingRow, CaptureRow) pair as a dataset line."""
    return RatedExample(
        prompt=[Message(**m) for m in capture.prompt],
        completion=[Message(role="assistant", content=capture.response)],
        label=rating.value > 0,
        comment=rating.comment,
        stars=rating.stars,
        reward=rating.reward,
        rlfleet=Provenance(
            rating_event_id=rating.event_id, actor=rating.actor, source=rating.source, value=rating.value,
            state=rating.state, train_model=rating.train_model, rated_at=rating.created, changed_at=rating.changed,
            capture_id=capture.id, capture_event_id=capture.event_id, capture_source=capture.source,
            conversation=capture.conversation, message_ref=capture.message_ref, owner=capture.owner,
            model=capture.model, adapter_version=capture.adapter_version, captured_at=capture.created,
            behaviour_logprobs=capture.behaviour_logprobs, behaviour_token_ids=capture.behaviour_token_ids,
            finish_reason=capture.finish_reason,
        ),
    )


def write_jsonl(examples: Iterable[RatedExample], path: Path, force: bool = False) -> int:
    """Write atomically (a partial file never replaces a good one, and a failure leaves nothing behind);
    an existing file only with ``force``. The number of lines."""
    n = 0
    with staged(path, "file", force) as tmp, tmp.open("w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(ex.model_dump_json(exclude_none=True) + "\n")
            n += 1
    return n


def write_dataset(examples: list[RatedExample], folder: Path) -> int:
    """A Hugging Face `datasets` folder (``load_from_disk``) with the same columns: a new or empty folder,
    written as atomically as :func:`write_jsonl`."""
    try:
        import datasets
    except ImportError:
        from .errors import ConfigError

        raise ConfigError("--format datasets needs the `datasets` package: pip install datasets") from None
    rows = [json.loads(ex.model_dump_json()) for ex in examples]
    with staged(folder, "folder") as tmp:
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp))
    return len(rows)


def _problem(ex: RatedExample) -> str | None:
    """Why a well-formed example still cannot be a rating here (None: it can)."""
    if len(ex.response) > MAX_TEXT_CHARS or not ex.response.strip():
        return "completion is empty or too long"
    if ex.label != (ex.rlfleet.value > 0):
        return "label and rlfleet.value disagree"
    return None


def _skip(report: ImportReport, where: str, why: str, max_errors: int) -> None:
    report.skipped["invalid"] += 1
    if len(report.errors) < max_errors:
        report.errors.append(f"{where}: {why}")


def _valid(report: ImportReport, where: str, parse: Callable[[], RatedExample],
           max_errors: int) -> RatedExample | None:
    """The example ``parse()`` makes of the line or row ``where``, or None, counted in ``report``."""
    try:
        ex = parse()
    except ValidationError as exc:
        _skip(report, where, describe_validation_error(exc, f"invalid {where.split()[0]}"), max_errors)
        return None
    if (why := _problem(ex)) is not None:
        _skip(report, where, why, max_errors)
        return None
    return ex


def read_jsonl(path: Path, report: ImportReport, max_errors: int = 20) -> Iterator[RatedExample]:
    """The valid lines of ``path``; each bad one is counted in ``report`` with its line number."""
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            if len(raw) > MAX_LINE_BYTES:
                _skip(report, f"line {n}", f"line is {len(raw):,} bytes", max_errors)
                continue
            ex = _valid(report, f"line {n}", partial(RatedExample.model_validate_json, raw), max_errors)
            if ex is not None:
                yield ex


def read_dataset(folder: Path, report: ImportReport, max_errors: int = 20) -> Iterator[RatedExample]:
    """The valid rows of a folder :func:`write_dataset` wrote (``load_from_disk``); each bad one is
    counted in ``report`` with its row number. Arrow gives every row every column, so a field a row
    left out comes back as None: those are dropped before the row is checked, as the JSONL leaves them out."""
    from .errors import BadInput, ConfigError

    try:
        import datasets
    except ImportError:
        raise ConfigError("reading a datasets folder needs the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise BadInput(f"{folder} is not a folder `rlfleet export ratings --format datasets` wrote "
                       f"({type(exc).__name__})") from None
    if not isinstance(ds, datasets.Dataset):
        raise BadInput(f"{folder} holds several splits ({', '.join(ds)}): give the folder of one")
    for n, row in enumerate(ds, 1):
        ex = _valid(report, f"row {n}", partial(RatedExample.model_validate, _without_nones(row)), max_errors)
        if ex is not None:
            yield ex


def _without_nones(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value
