"""A stronger hindsight teacher (``train.teacher``): loaded once per trainer, checked to share the
policy's tokenizer, kept for the next runs.

The hindsight term compares the teacher's and the student's next-token distributions token id by
token id at the positions of the student's own answer; a teacher with another vocabulary would pair
unrelated tokens, so one is refused with the reason instead of teaching noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfleet.shared.errors import ConfigError
from rlfleet.shared.models import ModelRef, ModelUnavailable, load_tokenizer, resolve_model


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every token to the same id and end answers with the same token."""
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


class TeacherCache:
    """The one teacher model a trainer holds (a different spec replaces it)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._spec: str | None = None
        self._model: Any = None

    def get(self, spec: str, load: Callable[[ModelRef], Any]) -> Any:
        if spec == self._spec:
            return self._model
        try:
            ref = resolve_model(spec)
            tokenizer = load_tokenizer(ref)
        except ModelUnavailable as exc:
            raise ConfigError(f"train.teacher {spec!r}: {exc}") from None
        if not same_tokenizer(tokenizer, self._tokenizer):
            raise ConfigError(
                f"train.teacher {spec!r} does not share the model's tokenizer: the hindsight teacher is "
                "compared with the model token by token; pick one of the same family, or leave it unset "
                "(the model itself reads the hint)"
            )
        self._model, self._spec = None, None  # the old one's memory goes before the new one loads
        try:
            model = load(ref)
        except ModelUnavailable as exc:
            raise ConfigError(f"train.teacher {spec!r}: {exc}") from None
        self._model, self._spec = model, spec
        return model
