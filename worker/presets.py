"""Training presets and the resolved per-run configuration (the objective: docs/objective.md).

The learning rate is scaled to the model's size (it falls with the square root of the parameter
count): a rate that moves a preference on a small model collapses a large one. The sequence bands
are wide enough that an optimizer step does not push every sequence out of them after the first
step (a band that narrow would make a run learn about as much as one step). Why these values: the
measurements in bench/RESULTS.md (the learning benchmark, bench/learning, is what settles them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlfleet.shared.config import Preset, TrainSettings

from .training.advantages import Rule

REFERENCE_PARAMS = 135e6  # size at which the base learning rates below were measured


@dataclass(frozen=True)
class TrainConfig:
    lr: float
    steps: int
    rank: int
    alpha: int
    beta: float  # KL weight
    seq_band: tuple[float, float]  # geometric-mean ratio band; sequences outside are dropped
    token_band: tuple[float, float] = (0.5, 2.0)
    pos_weight: float = 1.2
    adv_clip: float = 2.0
    advantage: Rule = "ema"  # the advantage rule (training/advantages.py)
    adv_delta: float = 0.1  # asymmetric: how far below the run's mean reward the baseline sits
    neg_bound: float = 0.5  # asymmetric: the largest push a 👎 gives its answer
    # Class-balanced advantages (training/advantages.balance_classes): the rarer of liked and disliked
    # answers weighted up, by at most this factor, until both pull equally; 0 or 1: off.
    balance: float = 16.0
    # A 👎's push fades once its answer is less likely than under the base, by this many nats per
    # token (objective.fade_negatives); 0: it pushes for as long as the bands let it.
    neg_fade: float = 0.05
    grad_clip: float = 1.0
    ema_decay: float = 0.99
    max_tokens: int = 1024
    micro_batch_tokens: int = 2048
    # The KL anchor over the base's K likeliest next tokens and a tail bin (objective.top_k_kl);
    # 0: the k3 estimate on the answer's own token only.
    kl_top_k: int = 0
    # The weight of the unlikelihood term on the policy's own loops (training/loops.py); 0: off. On:
    # on a taste the model rarely shows, the versions trained with it kept the base's fluency on more
    # runs at about the same gain (bench/RESULTS.md, "unlikelihood on the policy's own loops").
    unlikelihood: float = 1.0
    # The weight of the entropy hinge (objective.entropy_excess): the trained policy's next-token
    # entropy on the rated answers is held at or below the base's, position by position; 0: off.
    entropy_hinge: float = 0.0
    max_mean_kl: float = 1.0  # a run that raises the mean per-token KL to the base by more is not promoted
    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"  # auto | bf16 | fp32 (training/precision.py); the config's default is auto
    objective: str = "mispo"  # mispo | soft | reinforce (objective.loss_for)
    clip_eps: float = 0.2  # soft: PPO clip range
    drift_tau: float = 0.05  # soft: a sequence's weight is exp(-its mean KL to the base / drift_tau)
    # Exploration with the user's reward model (training/exploration.py): answers sampled per prompt
    # (0: off), how many rated prompts, their length cap, the weight of their advantages, the AUC bar.
    # The product's defaults are the config's (shared/config.py); off here, a run built by hand
    # trains on the samples it is handed.
    explore: int = 0
    explore_prompts: int = 16
    explore_max_new_tokens: int = 64
    explore_weight: float = 0.5
    explore_cuts: int = 0  # an explored answer's best earlier sentence end tried beside it (0: off)
    explore_minibatches: int = 1  # explored answers split over the steps in turn (1: all in every step)
    reward_model_min_auc: float = 0.75
    # Hindsight distillation from the user's words (training/hindsight.py): the term's weight (0: off),
    # the teacher's top K, the smallest rating-direction gap a hinted answer needs, and a stronger
    # teacher model sharing the tokenizer (None: the base with the hint in context). The product's
    # defaults are the config's (shared/config.py); off here, as exploration is.
    hindsight: float = 0.0
    hindsight_top_k: int = 32
    hindsight_min_gap: float = 0.0
    teacher: str | None = None
    rewrite: bool = False  # the teacher's answers under the hints as liked ones (training/rewrite.py)


# beta, the KL anchor to the base: almost every rating of a taste the model rarely shows is a 👎, and
# the push off those answers raises the entropy until a small model loops; a near-zero anchor let
# the gate promote versions that learned the taste and repeated themselves, this one keeps most of
# the gain (bench/RESULTS.md, "the KL anchor"). lr: the class weights and the fading 👎 (balance,
# neg_fade) take most of a run's push off the many 👎s, and AdamW normalises the step, so at the
# rate measured without them a run moved the model a fraction as far and learned less; twice the
# rate gives it back with the fluency kept (bench/RESULTS.md, "class weights and a fading 👎").
# steps: half as many, at this rate or twice it, learned less and left the served versions repeating
# themselves more (bench/RESULTS.md, "fewer optimizer steps a run"): the last steps clean up the loops.
# careful and aggressive keep their ratio to balanced.
_PRESETS: dict[str, TrainConfig] = {
    "careful": TrainConfig(lr=2.4e-4, steps=6, rank=16, alpha=16, beta=0.08, seq_band=(0.9, 1.1), pos_weight=1.0),
    "balanced": TrainConfig(lr=4e-4, steps=8, rank=16, alpha=16, beta=0.04, seq_band=(0.8, 1.25)),
    "aggressive": TrainConfig(lr=6.4e-4, steps=12, rank=16, alpha=16, beta=0.02, seq_band=(0.67, 1.5)),
}


def preset(name: Preset) -> TrainConfig:
    return _PRESETS[name]


CPU_MICRO_BATCH_TOKENS = 512


def resolve(
    settings: TrainSettings, n_params: float | None = None, moe: bool = False, device: str | None = None
) -> TrainConfig:
    """The preset with the model-size scaling, MoE adjustments, then the user's explicit overrides.
    ``device``: where the run trains (the micro-batch default depends on it)."""
    cfg = _PRESETS[settings.preset]
    lr = cfg.lr
    if n_params:
        lr *= min(1.0, (REFERENCE_PARAMS / n_params) ** 0.5)
    rank, beta = cfg.rank, cfg.beta
    if moe:  # routed experts drift more per step: smaller steps, more capacity, softer anchor
        lr, rank, beta = lr * 0.5, rank + 8, beta * 0.5
    cfg = replace(
        cfg,
        lr=settings.lr or lr,
        steps=settings.steps or cfg.steps,
        rank=settings.rank or rank,
        alpha=settings.rank or rank,
        beta=beta if settings.beta is None else settings.beta,
        kl_top_k=cfg.kl_top_k if settings.kl_top_k is None else settings.kl_top_k,
        unlikelihood=cfg.unlikelihood if settings.unlikelihood is None else settings.unlikelihood,
        entropy_hinge=cfg.entropy_hinge if settings.entropy_hinge is None else settings.entropy_hinge,
        balance=cfg.balance if settings.balance is None else settings.balance,
        neg_fade=cfg.neg_fade if settings.neg_fade is None else settings.neg_fade,
        seq_band=settings.seq_band or cfg.seq_band,
        max_tokens=settings.max_tokens,
        micro_batch_tokens=settings.micro_batch_tokens
        or (CPU_MICRO_BATCH_TOKENS if device == "cpu" else cfg.micro_batch_tokens),
        seed=settings.seed,
        device=settings.device,
        precision=settings.precision,
        objective=settings.objective,
        advantage=settings.advantage,
        explore=settings.explore,
        explore_prompts=settings.explore_prompts,
        explore_max_new_tokens=settings.explore_max_new_tokens,
        explore_weight=settings.explore_weight,
        explore_cuts=settings.explore_cuts,
        explore_minibatches=settings.explore_minibatches,
        reward_model_min_auc=settings.reward_model_min_auc,
        hindsight=settings.hindsight,
        hindsight_top_k=settings.hindsight_top_k,
        hindsight_min_gap=settings.hindsight_min_gap,
        teacher=settings.teacher,
        rewrite=settings.rewrite,
    )
    return cfg


def for_trainer(settings: TrainSettings, trainer: Any) -> TrainConfig:
    """``settings`` resolved for the model ``trainer`` holds and the device it trains on."""
    return resolve(settings, trainer.n_params, trainer.is_moe, device=str(trainer.device))
