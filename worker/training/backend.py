"""What a training backend provides: tensor-level operations on one model, nothing about a run.

The loop (:mod:`.loop`), the learning signal (:mod:`.policy_gradient`) and the measurements
(:mod:`.scoring`) are written once over this protocol; a backend (:mod:`.torch_backend`,
:mod:`.mlx_backend`) only loads a model, wraps it with a LoRA, computes log-probs and losses on
its own tensors, steps its optimizer, saves a peft adapter and samples answers. ``Tensor`` below is
the backend's own array type and ``Batch`` its collated micro-batch; the loop only passes them back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

from ..batching import Encoded
from ..presets import TrainConfig

Tensor = Any
Batch = Any
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class StepStats:
    """One micro-batch's contribution to an optimizer step, as plain numbers (and, where a FromStep
    behaviour asked for them, the fixed log-probs its pass gave)."""

    loss: float  # the micro-batch's loss (a mean over its sequences)
    mean_kl: float  # mean k3 KL to the reference per response token
    n_tokens: float  # response tokens in the micro-batch
    accepted_tokens: float  # response tokens the objective's token filter kept
    accepted_seqs: float  # sequences the objective's sequence filter kept
    anchor_kl: float | None = None  # mean top-k anchor KL per response token, with ``extras.top``
    entropy_excess: float | None = None  # mean rise of the entropy over the base's, with ``extras.entropy``
    hindsight_kl: float | None = None  # the hindsight term's value, with ``extras.teacher``
    # With a FromStep ``beh``: the behaviour and reference log-probs the pass gave (the backend's tensors).
    fixed: tuple[Tensor, Tensor] | None = None


@dataclass(frozen=True)
class FromStep:
    """``accumulate``'s ``beh`` where the first optimizer step's own forward pass gives a micro-batch's
    fixed log-probs: before any update the policy is the run-start policy (and a fresh LoRA, whose B is
    0, the base), in the same batch and numerics, so the step's pass stands in for the run-start pass
    (with ``reference``, for the reference pass too) of the micro-batches it trains. ``recorded`` rows
    are written in as :meth:`Backend.with_recorded` does, moved by the pass minus ``full`` (the fp32
    pass of a bf16 session; None: not moved)."""

    recorded: Sequence[tuple[int, int, Sequence[float]]] = ()
    full: Tensor | None = None
    reference: bool = False


@dataclass(frozen=True)
class RefExtras:
    """What the reference pass keeps beside the base's log-probs, for the terms that compare the
    trained policy's whole next-token distribution with the base's (None: not asked for)."""

    top: Any = None  # (ids, log-probs) of the base's K likeliest next tokens at each response position
    entropy: Any = None  # the base's next-token entropy at each response position
    # The hindsight teacher's targets for the micro-batch (:meth:`Backend.teacher_targets`): None when
    # none of its answers came with words the teacher could read.
    teacher: Any = None


class TopRow(NamedTuple):
    """One answer as a model scored it, position by position over its response tokens (numpy arrays)."""

    ids: Any  # [n, K] the K likeliest next tokens
    logprobs: Any  # [n, K] their log-probs
    token: Any  # [n] the log-prob of the answer's own token


class TokenSums(NamedTuple):
    """One answer's sums over its predicted tokens, for the gate's measurements."""

    logprob: float
    entropy: float
    kl: float  # exact KL to the base, summed over the answer's positions
    tokens: int


class RowScores(NamedTuple):
    """One answer measured by :meth:`Backend.score_rows`: under the active model, and where the KL
    pass ran the base beside it, under the base (its KL 0): the gate reads the base's sums from the
    candidate's pass instead of a pass of its own."""

    model: TokenSums
    base: TokenSums | None = None


class Backend(Protocol):
    tokenizer: Any
    device: str

    @property
    def n_params(self) -> int: ...

    @property
    def is_moe(self) -> bool: ...

    # -- model state ---------------------------------------------------------------------------

    def seed(self, seed: int) -> None:
        """Seed what a run draws (the LoRA's initial weights)."""

    def adapter(
        self,
        adapter_dir: Path | None,
        cfg: TrainConfig | None,
        trainable: bool = False,
        precision: str = "fp32",
    ) -> AbstractContextManager[Any]:
        """The model wrapped with a LoRA for the block (the folder's adapter, or a fresh one from
        ``cfg``); the base is exactly as before afterwards. Forward passes in the block use the
        active adapter, in ``precision`` (auto | bf16 | fp32: :mod:`.precision`) where the backend
        can; :attr:`precision` says which one they use."""

    @property
    def precision(self) -> str:
        """``bf16`` while the open session's forward passes run in bf16, else ``fp32``."""

    @property
    def step_stands_in(self) -> bool:
        """Whether :meth:`accumulate` takes a :class:`FromStep` for ``beh`` (then ``ref`` may be None)."""

    @property
    def rows_seeded(self) -> bool:
        """Whether :meth:`sample` draws each row from a seed of its own (its ``seeds``), so that a row's
        answer is the same in any batch: what lets the gate remember the base's answers per prompt."""

    def full_precision(self) -> AbstractContextManager[None]:
        """Forward passes in the block run in fp32 whatever the session's precision."""

    def reference(self) -> AbstractContextManager[None]:
        """Forward passes in the block are the base's (the adapter switched off)."""

    def teacher(self, spec: str | None) -> AbstractContextManager[None]:
        """Forward passes in the block are the hindsight teacher's: the model ``spec`` names (a folder
        or hub id, loaded once and kept; it must share the tokenizer, else ConfigError), or with None
        the base itself, the adapter switched off."""

    def save(self, out_dir: Path) -> None:
        """Write the active adapter to ``out_dir`` as a peft adapter folder."""

    # -- tensors -------------------------------------------------------------------------------

    def each(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(x) for x in items]``, where ``fn`` is one pass's work on one micro-batch (a forward, or
        :meth:`accumulate`): the backend may run several at once. Results in ``items``' order; the
        gradients of :meth:`accumulate` calls are accumulated in that order too."""

    def batches(self, encoded: Sequence[Encoded], budget: int) -> tuple[list[list[int]], list[Batch]]:
        """Length-bucketed micro-batches of at most ``budget`` padded tokens: the sample indices
        of each, and the collated batch on the device."""

    def vector(self, values: Sequence[float]) -> Tensor:
        """A float32 vector on the device."""

    def logprobs(self, batch: Batch) -> Tensor:
        """``[B, L]`` fp32 log-prob of each response token given its prefix, 0 elsewhere; no gradient."""

    def reference_logprobs(self, batch: Batch, top_k: int = 0, entropy: bool = False) -> tuple[Tensor, RefExtras]:
        """:meth:`logprobs`, and from the same pass what ``accumulate``'s ``extras`` compare with: the
        ``top_k`` likeliest next tokens at each response position with their log-probs (the top-k KL
        anchor), and with ``entropy`` the next-token entropy there (the entropy hinge)."""

    def response_top(self, batch: Batch, top_k: int) -> list[TopRow]:
        """Per row, its response positions as the active model scores them (no gradient): the ``top_k``
        likeliest next tokens with their log-probs, and the answer's own token's log-prob."""

    def teacher_targets(self, batch: Batch, rows: Sequence[tuple[TopRow, float] | None]) -> Any:
        """The hindsight term's targets for ``batch`` in this backend's layout, for ``accumulate``'s
        ``extras.teacher``: per row the teacher's :class:`TopRow` (as many positions as the row has
        response tokens) and the weight of each of its positions, or None for a row nobody teaches."""

    def with_recorded(
        self, logprobs: Tensor, rows: Sequence[tuple[int, int, Sequence[float]]], shift: Tensor | None = None
    ) -> Tensor:
        """A copy of ``logprobs`` with ``(row, start, values)`` written in at ``[row, start:]``, plus
        ``shift`` at the same positions when given (``[B, L]``, as ``logprobs``)."""

    def kl_sum(self, batch: Batch, ref: Tensor) -> tuple[float, float]:
        """The k3 KL of the active model to ``ref`` summed over response tokens, and their count."""

    # -- optimizer -----------------------------------------------------------------------------

    def begin_training(self, cfg: TrainConfig) -> None:
        """Bind ``cfg``'s objective and make the optimizer over the active adapter's weights;
        raise :class:`rlfleet.shared.errors.ConfigError` for an objective the backend lacks."""

    def begin_step(self) -> None:
        """Clear the accumulated gradient."""

    def accumulate(
        self, batch: Batch, beh: Tensor | FromStep, ref: Tensor | None, advantages: Tensor, share: float,
        extras: RefExtras | None = None,
    ) -> StepStats:
        """The objective on one micro-batch; its gradient, weighted by ``share``, is accumulated.
        ``beh`` a :class:`FromStep` (where :attr:`step_stands_in`): the fixed log-probs come from this
        pass (``ref`` None: with ``beh.reference``), and ``StepStats.fixed`` returns them.
        ``extras`` from :meth:`reference_logprobs` under :meth:`reference`: with ``top`` the KL term
        is the top-k anchor (:func:`rlfleet.worker.objective.top_k_kl`); with ``entropy`` the entropy
        hinge (:func:`rlfleet.worker.objective.entropy_excess`) is added at ``cfg.entropy_hinge``; with
        ``teacher`` the hindsight term (:func:`rlfleet.worker.objective.hindsight_kl`) at ``cfg.hindsight``."""

    def accumulate_unlikelihood(
        self, batch: Batch, marks: Sequence[tuple[int, int, Sequence[int]]], weight: float, share: float
    ) -> float:
        """The unlikelihood term (:func:`rlfleet.worker.objective.unlikelihood`) on one micro-batch of
        the policy's own answers, ``marks`` holding ``(row, start, positions)``: the tokens at
        ``start + position`` of that row are marked. Its gradient, times ``weight * share``, is
        accumulated; the term's value is returned."""

    def finish_step(self, apply: bool) -> None:
        """Clip the accumulated gradient; update the weights when ``apply``."""

    # -- measurements --------------------------------------------------------------------------

    def response_logprobs(self, batch: Batch) -> list[list[float]]:
        """Per row, the log-probs of its response tokens under the active model."""

    def pooled_hidden(self, batch: Batch) -> list[list[float]]:
        """Per row, the active model's last hidden layer (the one the output head reads) averaged
        over its response tokens, in fp32; no gradient. What the reward model sees of an answer."""

    def pooled_endings(self, batch: Batch, endings: Sequence[Sequence[int]]
                       ) -> tuple[list[list[float]], list[list[list[float]]]]:
        """:meth:`pooled_hidden` of the rows, and of each row's answer ended earlier: for row r, its
        first ``endings[r][j]`` answer tokens then the end token, in the same pass; raises
        NotImplementedError where the model cannot (the caller then encodes each ending as a row)."""

    def score_rows(self, batch: Batch, with_kl: bool) -> list[RowScores]:
        """Per row, its answer's token log-prob, entropy and (``with_kl``) KL-to-base sums; with
        ``with_kl``, the base's log-prob and entropy sums from the same pass of the base."""

    def teacher_divergence(self, batch: Batch, targets: Any) -> list[tuple[float, int]]:
        """Per row, the hindsight divergence (:func:`rlfleet.worker.objective.hindsight_kl`) of the
        active model from the teacher's ``targets`` (:meth:`teacher_targets`, weight 1 on a taught
        row) summed over the row's taught positions, and their count; no gradient. What the gate
        reads to tell learning from drift when the held-out answers are all of one class."""

    def sample(
        self, prompts: Sequence[list[dict]], max_new_tokens: int, seed: int,
        temperature: float = 0.7, top_p: float = 1.0, seeds: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """One answer per prompt (temperature 0: the likeliest), as token ids up to the end token; a
        prompt given k times gets k separate draws (exploration's k answers per prompt), the same
        ones for the same ``seed``. ``seeds``: each row's own seed, for the kernels that draw a row
        from a seed of its own (llama.cpp, MLX), so a row's answer does not depend on the rows beside
        it; torch's ``generate`` draws one stream per batch from ``seed``."""
