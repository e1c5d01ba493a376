"""The simulated user, through the real pipeline.

A scripted rater chats with the local model the way `rlfleet chat` is used: each answer is
captured (with its behaviour log-probs) and rated through the ingress use case a person's `/rl good|bad
[comment]` goes through, onto the Redis queue (a rater's comment is stored with the rating); the store
applies the events, the trigger queues a run when pending ratings reach the threshold, the training worker
trains (objective, evaluation gate and all) and writes a version, and the responder picks it up
for the next answers. Held-out prompts, never rated, are sampled at checkpoints (fixed seeds, batched
generation) to measure the preferred-behaviour rate, the log-prob margin of held-out good over bad
answers, and the collapse signals.

With a second preference (``then``) the user changes their mind after ``switch_at`` ratings: the rate is
then the second preference's, and every checkpoint also scores the first (``first_rate``), so that a run
that learns the second by forgetting the first shows it.

The training worker runs in this process (an RQ burst after each trigger), so the user waits for
each run: compute is equal across objectives, and nothing else competes for the CPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.shared.config import ChatSettings, Config, TrainSettings
from rlfleet.shared.events import Capture, Rating
from rlfleet.shared.ingress.grammar import parse_rl
from rlfleet.shared.ingress.usecases import Send, UseCases
from rlfleet.shared.permissions import LOCAL_ACTOR, Actor

from .metrics import Checkpoint, collapse_signals, margin, preferred_rate, repeat_share
from .raters import Preference, controls

if TYPE_CHECKING:
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.responder import LocalResponder, Sample

TOPICS = [
    "the moon", "coffee", "trains", "gardening", "volcanoes", "chess", "bicycles", "honey", "rainbows",
    "penguins", "libraries", "bread", "thunder", "maps", "violins", "deserts", "glass", "bees",
    "lighthouses", "tea", "snowflakes", "rivers", "clocks", "kites", "mushrooms", "bridges", "owls",
    "salt", "comets", "origami", "castles", "jazz", "sponges", "wind", "elephants", "paper", "caves",
    "soap", "tides", "fireworks",
]  # fmt: skip
HELD_OUT_TOPICS = [
    "whales", "candles", "mountains", "pianos", "lemons", "spiders", "islands", "umbrellas",
    "magnets", "forests", "cheese", "rockets", "glaciers", "feathers", "tunnels", "compasses", "pumpkins",
    "parrots", "marbles", "waterfalls",
]  # fmt: skip
EXAMPLES = 3  # held-out answers kept as text per checkpoint
USER = Actor("cli", LOCAL_ACTOR)  # the simulated user: the data dir's own, as in `rlfleet chat`
CONVERSATION = "bench"
FORMS = ["Tell me about {}.", "What is interesting about {}?", "Explain {} to a child.", "Describe {}."]


def train_prompts() -> list[str]:
    return [FORMS[i % len(FORMS)].format(t) for i, t in enumerate(TOPICS)]


def heldout_prompts(n: int) -> list[str]:
    return [FORMS[(i + 1) % len(FORMS)].format(t) for i, t in enumerate(HELD_OUT_TOPICS[:n])]


def sample_in_batches(responder: LocalResponder, conversations: list[list[dict]], batch: int,
                      progress: Callable[[int], None] | None = None) -> list[Sample]:
    """One answer per conversation, ``batch`` per generate call, the k-th call seeded ``10_000 + k``:
    the same draws at every checkpoint, and for any responder measured on the same rows
    (bench/engine_fidelity.py). ``progress(done)`` before each call."""
    got: list[Sample] = []
    for b, start in enumerate(range(0, len(conversations), batch)):
        if progress is not None:
            progress(start)
        got += responder.sample(conversations[start:start + batch], seed=10_000 + b)
    return got


@dataclass
class BenchConfig:
    preference: Preference
    model: str = "smollm2-135m"
    ratings: int = 64
    objective: str = "mispo"  # mispo | soft | reinforce | kto
    threshold: int = 32
    preset: str = "balanced"
    heldout: int = 16  # held-out prompts
    samples: int = 4  # answers per held-out prompt per checkpoint
    batch: int = 32  # held-out answers per generate call
    comments: bool = True  # rate with the rater's comment (`/rl bad too long`), else the value alone
    stars: bool = False  # rate in stars where the preference grades them (`/rl 2 too long`)
    max_new_tokens: int = 48
    seed: int = 0
    device: str = "auto"
    engine: str = "torch"  # what draws the simulated chat's answers and the runs' samples (chat.engine)
    gate: bool = True
    overrides: dict = field(default_factory=dict)  # TrainSettings fields (lr, steps, seq_band, replay, ...)
    home: Path | None = None
    then: Preference | None = None  # the user's preference after ``switch_at`` ratings
    switch_at: int | None = None  # None: half of ``ratings``

    @property
    def switch(self) -> int | None:
        """How many ratings the user gives by the first preference (None: never switches)."""
        if self.then is None:
            return None
        return self.ratings // 2 if self.switch_at is None else self.switch_at

    def rater_at(self, given: int) -> Preference:
        """The preference the user rates by once ``given`` ratings are in."""
        switch = self.switch
        if self.then is None or switch is None or given < switch:
            return self.preference
        return self.then

    @property
    def measured(self) -> Preference:
        """The preference a checkpoint's rate is of: the one the user ends with."""
        return self.then or self.preference


@dataclass
class BenchResult:
    config: BenchConfig
    checkpoints: list[Checkpoint]
    runs: list[dict]
    seconds: float
    # The base model reading the user's most common 👎 comment as the hindsight teacher does (the hint in
    # the held-out prompt): its rate of the preferred behaviour, what hindsight distillation can reach.
    teacher: dict | None = None

    def summary(self) -> dict:
        first, last = self.checkpoints[0], self.checkpoints[-1]
        return {
            "preference": self.config.preference.name,
            "then": self.config.then.name if self.config.then else None,
            "switch_at": self.config.switch,
            **self._first_preference(),
            "replayed": sum(c.replayed for c in self.checkpoints),
            "ratings": last.ratings,
            "objective": self.config.objective,
            "model": self.config.model,
            "preset": self.config.preset,
            "threshold": self.config.threshold,
            "seed": self.config.seed,
            "overrides": dict(self.config.overrides),
            "base_rate": first.rate,
            "final_rate": last.rate,
            "delta": last.rate - first.rate,
            "ci95": list(last.ci95),
            "base_ci95": list(first.ci95),
            "margin_before": first.margin,
            "margin_after": last.margin,
            "answer_words_before": first.answer_words,
            "answer_words_after": last.answer_words,
            "distinct2_before": first.distinct2,
            "distinct2_after": last.distinct2,
            "base_distinct2": first.distinct2,
            "final_distinct2": last.distinct2,
            "base_repeat": first.repeat,
            "final_repeat": last.repeat,
            "entropy_ratio": last.entropy_ratio,
            # Served because the gate judged them (not a run with no held-out ratings to judge on).
            "promoted": sum(1 for r in self.runs if r["state"] == "succeeded" and r.get("verdict") == "promoted"),
            # The last run's cross-validated AUC of the reward model fitted on the user's ratings.
            "reward_model_auc": self.runs[-1].get("reward_model_auc") if self.runs else None,
            # The last run's mean gap of the hindsight teacher over the rated answers it read words on
            # (worker/training/hindsight.py); None without comments or with train.hindsight 0.
            "teacher_gap": self.runs[-1].get("teacher_gap") if self.runs else None,
            **(self.teacher or {"teacher_rate": None, "teacher_ci95": None, "teacher_hint": None,
                                "teacher_rate_seconds": 0.0}),
            "comments": self.config.comments,
            "stars": self.config.stars,
            "engine": self.config.engine,
            "controls_delta": {k: last.controls[k] - first.controls[k] for k in first.controls},
            "runs": self.runs,
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "seconds": self.seconds,
        }

    def _first_preference(self) -> dict:
        """With ``then``: the first preference's rate at the start, at the switch (what was learned) and
        at the end, and how much of what was learned was kept (``first_kept``: end minus switch)."""
        switch = self.config.switch
        if switch is None:
            return {}
        at = next((c for c in self.checkpoints if c.ratings == switch), self.checkpoints[-1])
        last = self.checkpoints[-1]
        learned, kept = at.first_rate, last.first_rate
        return {"first_base_rate": self.checkpoints[0].first_rate, "first_switch_rate": learned,
                "first_final_rate": kept, "first_final_ci95": list(last.first_ci95 or ()),
                "first_kept": kept - learned if kept is not None and learned is not None else None}


Report = Callable[[str, int, int], None]  # (what, done, total)


def run_benchmark(bc: BenchConfig, report: Report | None = None) -> BenchResult:
    from rq import Queue, SimpleWorker

    from rlfleet.cli import dispatch
    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.shared.permissions import PermissionTable
    from rlfleet.shared.queue import TRAIN_QUEUE, open_queue
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.responder import LocalResponder
    from rlfleet.worker import trainer_cache
    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.training.scoring import score_model

    started = time.perf_counter()
    say = report or (lambda *_: None)
    home = Path(bc.home or tempfile.mkdtemp(prefix="rlfleet-learning-"))
    settings = TrainSettings(
        threshold=bc.threshold, preset=bc.preset, device=bc.device, gate=bc.gate,
        objective="mispo" if bc.objective == "kto" else bc.objective, seed=bc.seed, **bc.overrides,
    )
    # The engine draws the training runs' samples too (exploration, the gate's answers), as a user's does.
    cfg = Config(home=home, model=bc.model, train=settings, chat=ChatSettings(engine=bc.engine))
    cfg.save()
    # The worker's jobs read the config from the data dir named here, in this process.
    os.environ["RLFLEET_HOME"] = str(home)
    ref = resolve_model(bc.model)
    device = pick_device(bc.device)
    registry = AdapterRegistry(cfg.adapters_root, ref.slug)

    say("loading models", 0, 1)
    responder = LocalResponder(ref, registry.dir, device=device, max_new_tokens=bc.max_new_tokens,
                               temperature=cfg.chat.temperature, top_p=cfg.chat.top_p, engine=bc.engine)
    trainer = trainer_cache.get_trainer(cfg)
    if bc.objective == "kto":
        from .kto import KtoTrainer

        key = next(k for k, v in trainer_cache._TRAINERS.items() if v is trainer)
        trainer_cache._TRAINERS[key] = KtoTrainer(trainer)

    held = heldout_prompts(bc.heldout)
    eval_cfg = GateConfig(eval_samples=0)
    reference: dict = {}  # the base's held-out answers: fixed texts for margin and entropy

    def heldout_answers(given: int) -> list[tuple[str, Sample]]:
        """Every held-out prompt ``bc.samples`` times, ``bc.batch`` answers per generate call; the same
        seeds at every checkpoint."""
        rows = [prompt for prompt in held for _ in range(bc.samples)]
        got = sample_in_batches(responder, [[{"role": "user", "content": p}] for p in rows], bc.batch,
                                lambda done: say(f"held-out answers at {given} ratings", done, len(rows)))
        return list(zip(rows, got, strict=True))

    def checkpoint(given: int, since: int) -> Checkpoint:
        """The held-out measurements after ``given`` ratings; ``since``: the previous checkpoint's."""
        t0 = time.perf_counter()
        texts = heldout_answers(given)
        tokens = [a.token_ids for _, a in texts]
        verdicts = [bc.measured.rate(prompt, a.text) for prompt, a in texts]
        rate, ci, n = preferred_rate(verdicts)
        first_rate = first_ci = None
        if bc.then is not None:
            first_rate, first_ci, _ = preferred_rate([bc.preference.rate(p, a.text) for p, a in texts])
        words, distinct = collapse_signals(tokens, [a.text for _, a in texts])
        adapter = registry.path(responder.active_version) if responder.active_version else None
        if not reference:
            rows = [((a.messages, a.text), v) for (_, a), v in zip(texts, verdicts, strict=True) if a.text.strip()]
            pairs = [pair for pair, _ in rows]
            reference.update(
                comments=[bc.measured.judge(p, a.text).comment for p, a in texts],  # the hint's candidates
                pairs=pairs,
                good=[pair for pair, v in rows if v == 1],
                bad=[pair for pair, v in rows if v == -1],
                entropy=score_model(trainer, pairs, None, eval_cfg).entropy,
            )
        ent = score_model(trainer, reference["pairs"], adapter, eval_cfg).entropy
        good = trainer.mean_logprobs(reference["good"], adapter) if reference["good"] else []
        bad = trainer.mean_logprobs(reference["bad"], adapter) if reference["bad"] else []
        return Checkpoint(
            ratings=given, version=responder.active_version, rate=rate, ci95=ci, judged=n,
            margin=margin(good, bad), answer_words=words, distinct2=distinct,
            repeat=repeat_share(tokens, responder.tokenizer.eos_token_id),
            entropy_ratio=ent / reference["entropy"] if reference["entropy"] else float("nan"),
            seconds=time.perf_counter() - t0,
            controls={c.name: preferred_rate([c.rate(p, a.text) for p, a in texts])[0] for c in controls()},
            first_rate=first_rate, first_ci95=first_ci,
            replayed=sum(r["replayed"] or 0 for r in runs if since < r["after_ratings"] <= given),
            examples=[{"prompt": p, "answer": a.text} for p, a in texts[: EXAMPLES * bc.samples : bc.samples]],
        )

    handle = open_queue(cfg)
    cases = UseCases(PermissionTable.for_config(cfg), cfg.model, handle)
    runs: list[dict] = []
    try:
        marks = sorted({0, *range(bc.threshold, bc.ratings + 1, bc.threshold), bc.ratings, bc.switch or 0})
        checkpoints = [checkpoint(0, 0)]
        say(_checkpoint_line(checkpoints[-1]), 1, 1)
        # Before any adapter: the responder is the base, as the hindsight teacher is.
        teacher = teacher_rate(responder, bc, reference["comments"], held) if bc.comments else None
        prompts = train_prompts()
        given = asked = 0
        while given < bc.ratings:
            prompt = prompts[asked % len(prompts)]
            asked += 1
            say("rating answers", given, bc.ratings)
            a = responder.answer([{"role": "user", "content": prompt}], seed=bc.seed * 1_000_003 + asked)
            pref = bc.rater_at(given)
            judged = pref.graded(prompt, a.text) if bc.stars else pref.judge(prompt, a.text)
            if not a.text.strip() or judged.value is None:
                continue
            try:  # exactly what `rlfleet chat` sends
                cap = Capture(
                    source="cli", conversation=CONVERSATION, owner=USER.id, prompt=a.messages, response=a.text,
                    model=cfg.model, adapter_version=a.adapter_version, behaviour_logprobs=a.logprobs,
                    behaviour_token_ids=a.token_ids, finish_reason=a.finish_reason,
                )
            except ValueError:  # an answer the capture refuses (NUL bytes from a tiny model): not rated
                continue
            if not dispatch(handle, cfg, cap).get("ok"):
                continue
            result = dispatch(handle, cfg, rating_event(cases, cap.capture_id, judged.value,
                                                        judged.comment if bc.comments else None,
                                                        judged.stars if bc.stars else None))
            given += 1
            if str(result.get("training") or "").startswith("training run"):
                say(f"training after {given} ratings", 0, 1)
                SimpleWorker([Queue(TRAIN_QUEUE, connection=handle.redis)], connection=handle.redis).work(
                    burst=True
                )
                runs.append(_last_run(cfg, ref.slug, given, registry))
                say(_run_line(runs[-1]), 1, 1)
                responder.refresh()
            if given in marks and given > 0:
                checkpoints.append(checkpoint(given, checkpoints[-1].ratings))
                say(_checkpoint_line(checkpoints[-1]), 1, 1)
    finally:
        handle.close()
    return BenchResult(bc, checkpoints, runs, time.perf_counter() - started, teacher)


def teacher_rate(responder: LocalResponder, bc: BenchConfig, said: list[str | None], held: list[str]) -> dict | None:
    """The preferred-behaviour rate of the base reading a hint, on the held-out prompts: the hint is the
    comment the user's rater gives most often on the base's held-out answers (None: it gives none)."""
    from rlfleet.worker.training.hindsight import with_hint

    started = time.perf_counter()
    comments = [c for c in said if c]
    if not comments:
        return None
    hint = max(set(comments), key=comments.count)
    prompts = [p for p in held for _ in range(bc.samples)]
    rows = [with_hint([{"role": "user", "content": p}], hint) for p in prompts]
    got = sample_in_batches(responder, rows, bc.batch)
    rate, ci, _ = preferred_rate([bc.measured.rate(p, a.text) for p, a in zip(prompts, got, strict=True)])
    return {"teacher_rate": rate, "teacher_ci95": list(ci), "teacher_hint": hint,
            "teacher_rate_seconds": time.perf_counter() - started}  # part of the run's seconds


def typed(value: int, comment: str | None, stars: int | None = None) -> str:
    """What the user types to rate the answer just given: ``/rl bad too long, keep it under 25 words``,
    or in stars ``/rl 2 too long``."""
    head = str(stars) if stars is not None else "good" if value > 0 else "bad"
    return f"/rl {head}" + (f" {comment}" if comment else "")


def rating_event(cases: UseCases, capture_id: str, value: int, comment: str | None,
                 stars: int | None = None) -> Rating:
    """The rating event the ingress makes of the user's typed ``/rl good|bad|1-5 [comment]`` (as the
    terminal chat does: the answer addressed by its capture id)."""
    cmd = parse_rl(typed(value, comment, stars))
    if cmd.verb not in ("good", "bad"):  # e.g. a comment past the command's length limit
        raise ValueError(f"the rating {typed(value, comment, stars)[:60]!r}... is not a /rl good|bad command")
    outcome = cases.rate(USER, CONVERSATION, 1 if cmd.verb == "good" else -1, cmd.arg, target=capture_id,
                         stars=cmd.stars)
    if not isinstance(outcome, Send) or not isinstance(outcome.event, Rating):
        raise RuntimeError(f"the ingress refused the simulated user's rating: {outcome!r}")
    return outcome.event


# The resolved training settings a report labels runs by (a setting left at the preset's value has
# no override, and the preset changes between commits: the label says what really ran).
TRAIN_KEYS = ("lr", "steps", "beta", "kl_top_k", "unlikelihood", "entropy_hinge", "advantage", "balance",
              "neg_fade", "explore", "explore_weight", "explore_cuts", "explore_minibatches", "hindsight",
              "teacher", "rewrite")


def _checkpoint_line(c: Checkpoint) -> str:
    """A checkpoint in one line: a run killed before its JSON still leaves its figures in the log."""
    lo, hi = c.ci95
    return (f"measured after {c.ratings} ratings: rate {c.rate:.2f} ({lo:.2f}-{hi:.2f}), "
            f"repeated trigrams {c.repeat:.1%}, distinct-2 {c.distinct2:.2f}, entropy x{c.entropy_ratio:.2f}")


def _run_line(r: dict) -> str:
    why = r["reason"] or r["error"] or ""
    return (f"run after {r['after_ratings']} ratings: {r['version']} {r['state']}{f' ({why})' if why else ''}; "
            f"explored {r['explored']}, reward model AUC {r['reward_model_auc']}, {r['seconds'] or 0:.0f} s")


def _last_run(cfg: Config, slug: str, given: int, registry: AdapterRegistry) -> dict:
    from rlfleet.shared.store import Store

    run = Store(cfg.db_url).latest_run(slug)
    ran = (registry.meta(run.version).get("config") or {}) if run.version else {}
    train = {k: ran[k] for k in TRAIN_KEYS if k in ran} | {"replay": cfg.train.replay, "fallback": cfg.train.fallback}
    m = run.metrics or {}
    keys = ("ratings_used", "replayed", "heldout_margin_before", "heldout_margin_after", "final_mean_kl",
            "accepted_token_frac", "accepted_seq_frac", "reward_model_auc", "reward_model_reason", "explored",
            "explore_reason", "explore_seconds", "explored_looping", "explored_cut", "explored_ended_earlier",
            "explored_abs_advantage_median", "n_tokens", "ratings_cut",
            "class_weight", "seconds", "precision", "tokens_per_s", "verdict", "reason",
            # the hindsight teacher (worker/training/hindsight.py): answers with words, taught, the gap
            "hinted", "hint_taught", "teacher_gap", "teacher_seconds", "hindsight_kl_start", "hindsight_kl",
            "rewritten", "rewrites_tried",
            # what the gate measured on its own samples (worker/gate.py): why it promoted or refused
            "heldout_kl", "entropy_ratio", "distinct2_ratio", "repetition", "repetition_base",
            # held-out answers all of one class, with words: the hindsight teacher as the other side
            "heldout_one_class", "heldout_hinted", "heldout_teacher_div_before", "heldout_teacher_div_after",
            "heldout_teacher_noise", "heldout_toward_teacher",
            # a version served from halfway through its run, and why the whole run was refused
            "fallback", "steps_served", "refused_full")
    return {"after_ratings": given, "version": run.version, "state": run.state, "error": run.error,
            **{k: m.get(k) for k in keys}, "train": train}
