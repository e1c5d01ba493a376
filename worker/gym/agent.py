"""The environment agent: LlamaGym's ``Agent`` loop (act, assign_reward, terminate_episode) on the
served version of a local model, training inline on rlfleet's own run path.

Every step is answered by the version ``CURRENT`` names, with its behaviour log-probs recorded as
`rlfleet chat` records them. A closed episode is stored like chat answers are: each step a capture
(source ``gym``, the environment's name as its actor and owner, the episode as its conversation) and a
rating of it, a 👍 when the step's discounted return is positive and a 👎 otherwise, with the step's
reward (its own column; the comment says reward and return in words), so episodes show in `rlfleet
status`, `history`, the web app and the export. Such ratings train only in an agent's runs: an agent
made again on the same data dir and environment takes up the stored episodes no run trained on (a batch
left unfilled when the last one stopped) into its first batch. When
``episodes_per_update`` episodes are closed, one training run goes through the worker's own
(:func:`rlfleet.worker.orchestrate.train_candidate` and ``conclude``: the trainer, the objective, a
committed version, the ledger): each step trains with its discounted return against a baseline,
the batch's mean return at the same step (``baseline="batch"``) or the model's reward EMA
(``baseline="ema"``), through the same advantage clip, class balance and loss as a rating.

The rating gate is off for gym runs (it judges held-out ratings; an environment has none). Given
``heldout_env``, a run's candidate plays ``heldout_episodes`` episodes of it on fixed seeds, as its
parent did on the same seeds and sampling seeds, and is promoted unless its mean return is worse beyond
noise (:mod:`rlfleet.gym.heldout`); without one, a run is promoted when its own checks pass (finite
loss, KL bound).

With ``background=True`` a full batch trains in the training worker while the loop goes on acting
with the served version (each answer reads ``CURRENT``, so it switches when the run is promoted): the
worker that serves this data dir's queue (``rlfleet up``, ``rlfleet worker --queue train``, or one on
another machine sharing the Redis, database and data dir), or else one the agent starts as its child
process and stops in :meth:`Agent.close` (its log: ``<home>/logs/worker-train.log``). The worker
trains and commits the candidate (:mod:`rlfleet.worker.agent_runs`); a thread of the agent waits for it,
plays the held-out episodes and serves it, so the environment and the agent's methods never leave its
process. Batches that fill up meanwhile train next, in order. ``terminate_episode`` then hands out a
finished run's statistics, one per call, and ``wait()`` the rest.
"""

from __future__ import annotations

import atexit
import math
import numbers
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError
from rq import Queue, Worker

from rlfleet.shared.config import Config, TrainSettings, data_dir, load_config
from rlfleet.shared.errors import BadInput, RlfleetError
from rlfleet.shared.events import Capture, Message, Rating, describe_validation_error, well_formed
from rlfleet.shared.home import check_home
from rlfleet.shared.job_names import GYM_RUN_JOB, train_job_id
from rlfleet.shared.lifecycle import exit_on_stop_signals_by_default
from rlfleet.shared.llamacpp_engine import ENGINES
from rlfleet.shared.models import model_slug, pick_device, resolve_model
from rlfleet.shared.queue import (
    TRAIN_QUEUE,
    QueueHandle,
    inline_holder,
    open_queue,
    progress_key,
    train_lock_key,
    wait_for,
)
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.responder import TurnCache
from rlfleet.shared.status import publish_snapshot
from rlfleet.shared.store import Store
from rlfleet.shared.workers import forget_dead_workers
from rlfleet.worker.agent_runs import GymRunRequest, candidate_result
from rlfleet.worker.context import Context
from rlfleet.worker.orchestrate import Candidate, ProgressBoard, RunInputs, conclude, gate_config, train_candidate
from rlfleet.worker.samples import TrainSample, drawn_by
from rlfleet.worker.training.loop import NothingToLearn
from rlfleet.worker.trigger import LOCK_TTL

from .heldout import ReturnsVerdict, judge_returns, play_lockstep
from .training_worker import ChildWorker, WorkerGaveUp

Baseline = Literal["batch", "ema"]
SOURCE = "gym"

# What an environment agent trains with unless told otherwise: no rating gate (it judges held-out
# ratings, which an environment has none of), nothing explored by a reward model of ratings, no
# hindsight teacher (it reads a rating's words), no replay of earlier ratings, and no unlikelihood on
# the policy's own loops: its checks sample answers three times a run (about 40 % of a Blackjack
# run's training on the default model) to keep chat prose from looping, where an agent's short
# actions are judged by the environment's return instead.
GYM_TRAIN_DEFAULTS: dict[str, Any] = {"gate": False, "explore": 0, "hindsight": 0.0, "rewrite": False,
                                      "replay": 0.0, "unlikelihood": 0.0}


class GymError(RlfleetError):
    """A misuse of the agent loop, or a method of the agent that failed; nothing recorded is lost."""


@dataclass
class Step:
    """One turn: the conversation it answered, the answer with its behaviour log-probs, its reward."""

    prompt: list[dict]
    response: str
    token_ids: list[int]
    logprobs: list[float]
    adapter_version: str | None
    finish_reason: str
    reward: float = 0.0
    error: str | None = None  # why extract_action failed on this answer (the step is kept)


@dataclass
class Episode:
    id: str
    steps: list[Step] = field(default_factory=list)
    # per step, filled when the episode is closed
    returns: list[float] = field(default_factory=list)
    rating_ids: list[int | None] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return sum(s.reward for s in self.steps)


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}``, the return from each step to the episode's end."""
    out = [0.0] * len(rewards)
    g = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = float(rewards[t]) + gamma * g
        out[t] = g
    return out


def step_baselines(episodes: Sequence[Episode]) -> list[float]:
    """The batch's mean return at each step index, over the episodes that reached it."""
    depth = max((len(e.returns) for e in episodes), default=0)
    means = []
    for t in range(depth):
        at = [e.returns[t] for e in episodes if len(e.returns) > t]
        means.append(sum(at) / len(at))
    return means


class Agent:
    """Subclass with :meth:`get_system_prompt`, :meth:`format_observation` and :meth:`extract_action`,
    then loop ``act`` / ``assign_reward`` / ``terminate_episode`` over an environment's episodes.

    ``model``: an alias, a local folder or a hub id; ``home``: the data dir the episodes, runs and
    versions live in (default: a fresh one under the user's data dir, ``gym/<class>-<time>``);
    ``episodes_per_update``: closed episodes per training run; ``gamma``: the discount over turns;
    ``baseline``: ``"batch"`` (the batch's mean return per step) or ``"ema"`` (the model's reward EMA);
    ``env``: the environment's name, stored with every step (default: the class's name).
    ``background``: train in the training worker while the loop goes on acting (see the module's
    docstring).
    ``heldout_env``: a Gymnasium environment (or a function making one) for the gate: each candidate
    plays ``heldout_episodes`` episodes from seeds ``heldout_seed``, ``heldout_seed + 1``, ... (at most
    ``heldout_max_steps`` steps each; an ``extract_action`` that raises ends the episode with what it
    has) and is served only if its mean return is not worse than its parent's beyond noise;
    ``heldout_batch`` of them play at once, their turns answered in one batched call.
    ``answer_prefix``: text every answer starts with, written for the model (a prefill such as
    ``"Action:"``): the model writes only what follows it, and is trained on that alone;
    :meth:`extract_action` reads the whole answer, prefix included. A small model that rarely keeps to
    an answer format keeps to it this way, and a run's credit lands on the tokens that decide the action
    (end the prefix without a space: the model writes the space with the token after it, as it was
    trained to). :meth:`get_answer_prefix` may be overridden instead.
    ``max_new_tokens``, ``temperature``, ``top_p``: how each step is answered (temperature 1 and top-p
    1 by default: the recorded log-probs then describe the policy that sampled); ``engine``: what
    draws each step's tokens, as ``chat.engine`` (``auto``: llama.cpp for a GGUF model on a CPU where
    llama-cpp-python is installed; the log-probs are the torch model's either way); every other keyword
    is a training setting (``preset``, ``device``, ``lr``, ``steps``, ``seed``, ... as in config.toml's
    ``[train]``).
    """

    def __init__(self, model: str = "smollm2-135m", home: str | Path | None = None, episodes_per_update: int = 16,
                 *, gamma: float = 1.0, baseline: Baseline = "batch", env: str | None = None,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                 heldout_env: Any = None, heldout_episodes: int = 32, heldout_seed: int = 1_000_000,
                 heldout_max_steps: int = 64, heldout_batch: int = 16, background: bool = False,
                 engine: str = "auto", answer_prefix: str = "", **settings: Any) -> None:
        if isinstance(episodes_per_update, bool) or not isinstance(episodes_per_update, int) \
                or episodes_per_update < 1:
            raise GymError(f"episodes_per_update is a whole number of at least 1, not {episodes_per_update!r}")
        if not _is_number(gamma) or not 0.0 <= gamma <= 1.0:
            raise GymError(f"gamma is a number in [0, 1], not {gamma!r}")
        if baseline not in ("batch", "ema"):
            raise GymError(f"baseline {baseline!r} is not 'batch' or 'ema'")
        if baseline == "batch" and episodes_per_update == 1:
            raise GymError("with one episode per update the batch baseline is that episode's own return, so "
                           "nothing ever beats it: use episodes_per_update of 2 or more, or baseline='ema'")
        if engine not in ENGINES:
            raise GymError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
        if not isinstance(answer_prefix, str):
            raise GymError(f"answer_prefix is text, not {answer_prefix!r}")
        self.answer_prefix = answer_prefix
        if heldout_env is not None and (heldout_episodes < 2 or heldout_max_steps < 1 or heldout_batch < 1):
            raise GymError("heldout_episodes must be at least 2 (noise is measured between them), "
                           "heldout_max_steps and heldout_batch at least 1")
        self.heldout_env, self.heldout_episodes = heldout_env, heldout_episodes
        self.heldout_seed, self.heldout_max_steps = heldout_seed, heldout_max_steps
        self.heldout_batch = heldout_batch
        self._heldout_pool: list[Any] | None = None
        self._heldout_returns: dict[str | None, list[float]] = {}  # per version (None: the base)
        self.background = background
        self._runs_lock = threading.Lock()
        self._runner: threading.Thread | None = None
        self._draining = False  # a runner is taking batches: set and cleared under _runs_lock only
        self._queued: list[list[Episode]] = []  # full batches waiting for the background runner
        self._finished: list[dict] = []  # background runs' statistics not handed out yet
        self._failure: BaseException | None = None
        self.episodes_per_update = episodes_per_update
        self.gamma, self.baseline = float(gamma), baseline
        self.env = env or type(self).__name__
        # Here, on the thread that made the agent: inline training may first open the embedded Redis on
        # the thread that plays, which cannot install a handler unless it is the main one, and a kill
        # must still reach the server's release.
        exit_on_stop_signals_by_default()
        ref = resolve_model(model)  # an unknown model is refused before a data dir is made
        if home is not None and not str(home).strip():
            raise GymError("home is empty: give the data dir's path, or leave it out for a fresh one")
        self.home = Path(home).expanduser() if home is not None else _fresh_home(type(self).__name__)
        try:
            check_home(self.home)
        except BadInput as exc:
            raise GymError(str(exc)) from None
        self.cfg = _config(self.home, model, settings)
        self.slug = model_slug(self.cfg.model)
        self.store = Store(self.cfg.db_url)
        self.registry = AdapterRegistry(self.cfg.adapters_root, self.slug)
        self._queue: QueueHandle | None = None
        self._workers: ChildWorker | None = None  # the training worker this agent started, if any

        from rlfleet.shared.responder import LocalResponder  # imports torch: after the cheap checks

        self.responder = LocalResponder(ref, self.registry.dir,
                                        device=pick_device(self.cfg.train.device), max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_p=top_p, engine=engine)
        self._episode = self._new_episode()
        self._messages: list[dict] = []
        self._turns = TurnCache()  # the episode's keys and values: a turn encodes only what it adds
        self._batch: list[Episode] = self._untrained_episodes()
        self.resumed_episodes = len(self._batch)  # stored by an earlier agent, trained with the next batch
        self._answers = 0  # seeds the steps' sampling: a run repeats with the same settings
        if background:
            self._ensure_worker()  # now: its model loads while the first batch is played

    # ------------------------------------------------------------------ the three methods to write

    def get_system_prompt(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define get_system_prompt()")

    def format_observation(self, observation: Any) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define format_observation(observation)")

    def extract_action(self, response: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define extract_action(response)")

    def get_answer_prefix(self) -> str:
        """Text every answer starts with (a prefill; "" for none): the ``answer_prefix`` given."""
        return self.answer_prefix

    # ------------------------------------------------------------------ the loop

    def prompt_for(self, observation: Any) -> list[dict]:
        """The conversation the next :meth:`act` would answer: the system prompt, the episode so far,
        and ``observation`` as the user's turn."""
        return self._prompt(self._messages, observation)

    def _prefix(self) -> str:
        """The answer prefix, "" for none (a blank one is none: there is nothing to continue)."""
        prefix = self._call("get_answer_prefix")
        if not isinstance(prefix, str):
            raise GymError(f"{type(self).__name__}.get_answer_prefix returned {prefix!r}: it must return text")
        return prefix if prefix.strip() else ""

    def _asked(self, messages: list[dict], prefix: str) -> list[dict]:
        """The prompt the model answers: ``messages``, and the prefix as the start of its answer."""
        return [*messages, {"role": "assistant", "content": prefix}] if prefix else messages

    def _said(self, token_ids: Sequence[int], text: str, prefix: str) -> str:
        """The answer as the model wrote it after ``prefix`` (its leading space kept: " 1" after
        "Action:"), or ``text`` without a prefix."""
        if not prefix:
            return text
        return self.responder.tokenizer.decode(list(token_ids), skip_special_tokens=True).rstrip()

    def _prompt(self, so_far: list[dict], observation: Any) -> list[dict]:
        text = self._call("format_observation", observation)
        if not isinstance(text, str) or not text.strip():
            raise GymError(f"{type(self).__name__}.format_observation returned {text!r}: it must return "
                           "non-empty text (the user's turn the model answers)")
        messages = so_far or [{"role": "system", "content": self._system_prompt()}]
        return [*messages, {"role": "user", "content": text}]

    def act(self, observation: Any) -> Any:
        """Answer ``observation`` in the episode's conversation with the served version; the action
        :meth:`extract_action` reads from the answer."""
        messages = self.prompt_for(observation)
        prefix = self._prefix()
        asked = self._asked(messages, prefix)
        answer = self.responder.answer(asked, seed=self.cfg.train.seed * 1_000_003 + self._answers,
                                       cache=self._turns)
        self._answers += 1
        said = self._said(answer.token_ids, answer.text, prefix)
        step = Step(prompt=asked, response=said, token_ids=list(answer.token_ids),
                    logprobs=list(answer.logprobs), adapter_version=answer.adapter_version,
                    finish_reason=answer.finish_reason)
        self._episode.steps.append(step)
        whole = prefix + said
        self._messages = [*messages, {"role": "assistant", "content": whole}]
        try:
            return self.extract_action(whole)
        except Exception as exc:
            step.error = f"{type(exc).__name__}: {exc}"
            raise GymError(f"{type(self).__name__}.extract_action failed on the answer {whole[:80]!r} "
                           f"({step.error}); the step is kept: assign_reward and terminate_episode as usual"
                           ) from exc

    def assign_reward(self, reward: float) -> None:
        """Add ``reward`` to the episode's last step (called more than once, the rewards add up)."""
        if not self._episode.steps:
            raise GymError(f"assign_reward({reward!r}) before any act() in this episode: nothing to reward "
                           "yet (call act(observation) first); nothing was recorded")
        if not _is_number(reward):
            raise GymError(f"a reward is a number, not {reward!r}; nothing was recorded")
        value = float(reward)
        if not math.isfinite(value):
            raise GymError(f"a reward must be finite, not {value}; nothing was recorded")
        # Every return of the episode is at most the sum of its rewards' sizes (gamma <= 1): finite
        # while that is, so terminate_episode() can always store it.
        if not math.isfinite(sum(abs(s.reward) for s in self._episode.steps) + abs(value)):
            raise GymError(f"this episode's rewards would add up past a float with {value}: scale them down; "
                           "nothing was recorded")
        self._episode.steps[-1].reward += value

    def terminate_episode(self) -> dict | None:
        """Close the episode and store it; when ``episodes_per_update`` are closed, train and return
        the run's statistics (else None). In the background: start the run, and return the statistics of
        the earliest finished run not handed out yet (else None; ``wait()`` hands out the rest)."""
        self._raise_failure()
        episode = self._episode
        if not episode.steps:
            raise GymError("terminate_episode() with no act() in this episode: there is nothing to close "
                           "(the previous episode was closed already)")
        episode.returns = discounted_returns([s.reward for s in episode.steps], self.gamma)
        episode.rating_ids = self._store(episode)
        self._batch.append(episode)
        self._episode, self._messages, self._turns = self._new_episode(), [], TurnCache()
        if len(self._batch) >= self.episodes_per_update:
            batch, self._batch = self._batch, []
            if not self.background:
                return self.train(batch)
            self._submit(batch)
        if not self.background:
            return None
        with self._runs_lock:
            return self._finished.pop(0) if self._finished else None

    @property
    def worker_pid(self) -> int | None:
        """The pid of the training worker this agent started (``background=True``), while it runs."""
        proc = self._workers.proc if self._workers is not None else None
        return proc.pid if proc is not None and proc.poll() is None else None

    def wait(self) -> list[dict]:
        """Wait for the background runs started so far; the statistics of every run that finished since
        ``terminate_episode`` last handed one out (a failed run raises its error here)."""
        runner = self._runner
        if runner is not None:
            runner.join()
        self._raise_failure()
        with self._runs_lock:
            done, self._finished = self._finished, []
        return done

    def _submit(self, batch: list[Episode]) -> None:
        with self._runs_lock:
            self._queued.append(batch)
            # not is_alive(): a runner that found the queue empty is alive until it returns, and
            # would leave this batch behind
            if not self._draining:
                self._draining = True
                self._runner = threading.Thread(target=self._drain, name="rlfleet-gym-train", daemon=True)
                self._runner.start()

    def _drain(self) -> None:
        """The background runner: train the queued batches in order; a failure stops it (what was
        queued stays queued, the next submit starts again) and is raised in the loop's thread."""
        while True:
            with self._runs_lock:
                if not self._queued or self._failure is not None:
                    self._draining = False
                    return
                batch = self._queued.pop(0)
            try:
                stats = self.train(batch)
            except BaseException as exc:
                with self._runs_lock:
                    self._failure, self._draining = exc, False
                return
            with self._runs_lock:
                self._finished.append(stats)

    def _raise_failure(self) -> None:
        with self._runs_lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise GymError(f"a background training run failed ({type(failure).__name__}: {failure}); its "
                           "episodes are stored, and the next full batch trains again") from failure

    # ------------------------------------------------------------------ training

    def train(self, episodes: Sequence[Episode]) -> dict:
        """One training run over ``episodes`` on the worker's run path; its statistics."""
        baselines = step_baselines(episodes) if self.baseline == "batch" else []
        samples = [
            TrainSample(rating_id=rid, prompt=s.prompt, response=s.response, reward=g,
                        behaviour_logprobs=s.logprobs or None, behaviour_token_ids=s.token_ids or None,
                        complete=s.finish_reason != "length", baseline=baselines[t] if baselines else None,
                        answered_by=drawn_by(s.adapter_version))
            for e in episodes for t, (s, g, rid) in enumerate(zip(e.steps, e.returns, e.rating_ids, strict=True))
        ]
        stats: dict[str, Any] = {
            "episodes": len(episodes), "turns": len(samples),
            "mean_return": sum(e.total_reward for e in episodes) / len(episodes),
            "served_before": self.registry.current(),
        }
        ctx = Context(self.cfg, self.store, self.slug, self.registry, 0.0)
        conn = self._redis()
        parent = self.registry.current()
        run_id = self.store.create_run(self.slug)
        self.store.start_run(run_id, parent)
        board = ProgressBoard.start(conn, self.slug, run_id)
        inputs = RunInputs(train=samples, held=[], retracted=[])
        stats["run_id"] = run_id
        started = time.perf_counter()
        checked = ""
        # Trained here: the lock says so, or `status` and a worker starting on this data dir take the
        # running run for one whose worker died (none holds it)
        lock = train_lock_key(self.slug)
        held = not self.background and bool(conn.set(lock, inline_holder(), nx=True, ex=LOCK_TTL))
        try:
            if self.background:
                candidate, stats["trained_by_pid"] = self._candidate_from_worker(conn, run_id, parent, samples)
            else:
                candidate = train_candidate(ctx, run_id, inputs, parent, gate_config(self.cfg), board)
            if self.heldout_env is not None and candidate.promote:
                verdict = self.judge(candidate.version, parent)
                candidate.metrics["heldout_returns"] = verdict.as_dict()
                stats["heldout"] = verdict.as_dict()
                checked = (f", held-out mean return {verdict.candidate_mean:.3g} against "
                           f"{verdict.parent_mean:.3g} on the same {verdict.episodes} episodes")
                if not verdict.ok:
                    candidate = replace(candidate, promote=False, reason=verdict.reason)
            result = conclude(ctx, conn, run_id, inputs, candidate,
                              trained=f"{len(samples)} turns of {len(episodes)} episodes", checked=checked)
        except NothingToLearn:  # every step's advantage is 0 (the trainer's words speak of ratings)
            against = "the batch's mean return at its step" if self.baseline == "batch" else "the reward EMA"
            why = (f"nothing to learn from these {len(samples)} steps of {len(episodes)} episodes: none returned "
                   f"more than its baseline ({against}), so no update would move the model")
            self.store.fail_run(run_id, why, state="skipped")
            return {**stats, "version": None, "promoted": False, "skipped": why,
                    "seconds": time.perf_counter() - started}
        except BaseException as exc:
            self.store.fail_run(run_id, _stopped_by(exc))
            raise
        finally:
            if held and conn.get(lock) == inline_holder().encode():
                conn.delete(lock)
            conn.delete(progress_key(self.slug))
            publish_snapshot(self.cfg, self.store, conn, self.slug)  # what status and the dashboard read
        m = candidate.metrics
        return {**stats, "version": candidate.version, "promoted": result.ok, "served": self.registry.current(),
                "message": result.message, "steps": m.get("steps"), "loss": m.get("loss"),
                "mean_kl": m.get("final_mean_kl"), "mean_advantage": m.get("mean_advantage"),
                "accepted_seq_frac": m.get("accepted_seq_frac"), "reason": candidate.reason,
                "seconds": time.perf_counter() - started}

    def _candidate_from_worker(self, conn: Any, run_id: int, parent: str | None,
                               samples: list[TrainSample]) -> tuple[Candidate, int | None]:
        """Run ``run_id`` in the training worker and wait for its candidate; and the worker's pid. The job
        has a rating run's job id, so a worker's recovery tells a live run from one its worker died in."""
        payload = GymRunRequest.of(self.cfg, run_id, parent, samples).model_dump_json()
        job = Queue(TRAIN_QUEUE, connection=conn).enqueue(
            GYM_RUN_JOB, payload, job_id=train_job_id(self.slug, run_id), job_timeout=LOCK_TTL,
            result_ttl=24 * 3600, failure_ttl=7 * 24 * 3600, description=f"{self.env}: train run {run_id}")
        while (result := wait_for(job, 5.0)) is None:
            self._ensure_worker()  # still waiting: the worker it was queued for may have gone away
        if "candidate" not in result and not result.get("skipped"):  # the job failed (or died with its worker)
            raise GymError(f"the training worker failed on run {run_id} ({result.get('message')})")
        return candidate_result(result), result.get("pid")

    def _ensure_worker(self) -> None:
        """A training worker on this data dir's queue: one that runs already, else a child of ours
        (:mod:`rlfleet.gym.training_worker`: started again when it dies)."""
        if self._workers is not None:
            try:
                self._workers.check()
            except WorkerGaveUp as exc:
                raise GymError(str(exc)) from None
            return
        conn = self._redis()
        forget_dead_workers(conn)
        if any(TRAIN_QUEUE in w.queue_names() for w in Worker.all(connection=conn)):
            return
        self._workers = ChildWorker(self.home)
        # A script that ends without close() (a kill, Ctrl-C, an exception) takes its worker with it at
        # once: the run in hand could not be concluded without this process, which plays the gate.
        atexit.register(self._workers.stop, now=True)

    # ------------------------------------------------------------------ the environment's gate

    def heldout_returns(self, version: str | None) -> list[float]:
        """``version``'s total reward on each held-out episode (None: the base), played once per version:
        a version's files never change, and the seeds are fixed. ``heldout_batch`` episodes play in
        lockstep, their turns answered in one batched call (one at a time when ``heldout_env`` is an
        environment rather than a function making one)."""
        if self.heldout_env is None:
            raise GymError("no heldout_env was given to this agent: there are no held-out episodes to play")
        if version not in self._heldout_returns:
            seeds = [self.heldout_seed + i for i in range(self.heldout_episodes)]
            with self.responder.pinned(version):
                self._heldout_returns[version] = play_lockstep(
                    self._heldout_envs(), seeds, self.respond_many(self.heldout_seed * 1_009), self._prompt,
                    lambda text: self._call("extract_action", text), self.heldout_max_steps)
        return self._heldout_returns[version]

    def respond_many(self, seed_base: int) -> Callable[[list[list[dict]], int], list[str]]:
        """The answers to many conversations in one batched call, each as :meth:`act` reads it (the
        answer prefix included): :func:`rlfleet.gym.heldout.play_lockstep`'s ``respond``, nothing
        recorded. Seeded by ``seed_base`` and the turn's seed, so two versions draw alike."""
        prefix = self._prefix()

        def respond(prompts: list[list[dict]], seed: int) -> list[str]:
            got = self.responder.sample([self._asked(p, prefix) for p in prompts], seed=seed_base + seed)
            return [prefix + self._said(s.token_ids, s.text, prefix) for s in got]

        return respond

    def judge(self, candidate: str, parent: str | None) -> ReturnsVerdict:
        """The environment's gate: ``candidate`` against ``parent`` on the same held-out episodes."""
        return judge_returns(self.heldout_returns(parent), self.heldout_returns(candidate))

    def _heldout_envs(self) -> list[Any]:
        """The environments the held-out episodes play in: the one given, or ``heldout_batch`` made once
        by the function given."""
        if self._heldout_pool is None:
            env = self.heldout_env
            if isinstance(env, type) or not hasattr(env, "step"):
                self._heldout_pool = [env() for _ in range(min(self.heldout_batch, self.heldout_episodes))]
            else:
                self._heldout_pool = [env]
        return self._heldout_pool

    def close(self) -> None:
        """Wait for a background run, then let go of the training worker it started, the Redis connection
        (and the embedded server it may have started) and the database's pooled connections. A
        background run that failed and was not raised yet is raised here, after all that (as
        :class:`GymError`; its episodes are stored and train with the next agent's first batch)."""
        if self._runner is not None:
            self._runner.join()
        if self._workers is not None:
            self._workers.stop()
            atexit.unregister(self._workers.stop)
            self._workers = None
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        self.store.close()
        self._raise_failure()

    # ------------------------------------------------------------------ helpers

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self, method)(*args)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise GymError(f"{type(self).__name__}.{method} failed ({type(exc).__name__}: {exc}); "
                           "nothing was recorded for this step") from exc

    def _system_prompt(self) -> str:
        text = self._call("get_system_prompt")
        if not isinstance(text, str):
            raise GymError(f"{type(self).__name__}.get_system_prompt returned {text!r}, not text")
        return text

    def _new_episode(self) -> Episode:
        return Episode(id=f"{self.env[:120]}/{uuid.uuid4().hex[:12]}")

    def _untrained_episodes(self) -> list[Episode]:
        """This environment's stored episodes that no run trained on, as they were played (a step no
        capture could hold, a blank answer, is not among them, nor its reward)."""
        episodes: dict[str, list[tuple[int, Step, int]]] = {}
        for rating, cap in self.store.untrained_steps(self.slug, self.env[:256]):
            t = int(cap.message_ref.rsplit(":", 1)[1]) if cap.message_ref and ":" in cap.message_ref else 0
            step = Step(prompt=list(cap.prompt), response=cap.response,
                        token_ids=list(cap.behaviour_token_ids or []), logprobs=list(cap.behaviour_logprobs or []),
                        adapter_version=cap.adapter_version, finish_reason=cap.finish_reason or "stop",
                        reward=float(rating.reward or 0.0))
            episodes.setdefault(cap.conversation, []).append((t, step, rating.id))
        out = []
        for conversation, steps in episodes.items():
            steps.sort(key=lambda x: x[0])
            episode = Episode(id=conversation, steps=[s for _, s, _ in steps], rating_ids=[r for _, _, r in steps])
            episode.returns = discounted_returns([s.reward for s in episode.steps], self.gamma)
            out.append(episode)
        return out

    def _redis(self) -> Any:
        if self._queue is None:
            self._queue = open_queue(self.cfg)
        return self._queue.redis

    def _store(self, episode: Episode) -> list[int | None]:
        """Each step of ``episode`` as a capture and its rating; the rating ids (None: a step no capture
        can hold, a blank answer: it still trains)."""
        events: list[Capture | Rating] = []
        stored: list[int] = []  # the steps stored, by index
        for t, (s, g) in enumerate(zip(episode.steps, episode.returns, strict=True)):
            try:
                cap = Capture(source=SOURCE, actor=self.env[:256], owner=self.env[:256], conversation=episode.id,
                              message_ref=f"{episode.id}:{t}",
                              prompt=[Message(role=m["role"], content=storable(m["content"])) for m in s.prompt],
                              response=storable(s.response), model=self.cfg.model, adapter_version=s.adapter_version,
                              behaviour_logprobs=s.logprobs or None, behaviour_token_ids=s.token_ids or None,
                              finish_reason="length" if s.finish_reason == "length" else "stop")
            except ValidationError:  # a blank answer (or a prompt too long to keep): it trains, unstored
                continue
            said = f"{self.env}: reward {s.reward:g}, return {g:g} (step {t + 1} of {len(episode.steps)})"
            if s.error:
                said += f"; extract_action failed: {s.error}"
            events += [cap, Rating(source=SOURCE, actor=self.env[:256], target=cap.capture_id,
                                   value=1 if g > 0 else -1, comment=said[:2000], reward=s.reward)]
            stored.append(t)
        ids: list[int | None] = [None] * len(episode.steps)
        if events:
            applied = self.store.apply_many(events, self.slug)
            for t, a in zip(stored, applied[1::2], strict=True):
                if not a.ok:
                    raise GymError(f"episode {episode.id} step {t + 1} was not stored: {a.message}")
                ids[t] = a.rating_id
        return ids


def storable(text: str) -> str:
    """``text`` as the store can hold it: a NUL byte (a small model may sample one) and lone surrogates
    as U+FFFD. The step trains on the answer as generated; only its stored copy differs."""
    return well_formed(text.replace("\x00", "\ufffd"))


def _stopped_by(exc: BaseException) -> str:
    """What ended a run, as `status` says it: a stop in words, a fault with its type and message."""
    if isinstance(exc, KeyboardInterrupt):
        return "stopped: the agent's process was interrupted (Ctrl-C or a kill); its episodes are kept"
    if isinstance(exc, SystemExit):
        return f"stopped: the agent's process exited (status {exc.code}); its episodes are kept"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _is_number(value: object) -> bool:
    """A real number a user meant as one (not a flag, not text that reads as one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fresh_home(name: str) -> Path:
    return data_dir() / "gym" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _config(home: Path, model: str, settings: dict[str, Any]) -> Config:
    """The data dir's config: written on first use with the model and the training settings (the gym
    defaults under them); ``settings`` given again later apply to this process only."""
    try:
        train = TrainSettings(**{**GYM_TRAIN_DEFAULTS, **settings})
    except ValidationError as exc:
        raise GymError(describe_validation_error(exc, "bad training setting")) from None
    chosen = {k: v for k, v in train.model_dump().items() if k in GYM_TRAIN_DEFAULTS or k in settings}
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GymError(f"cannot make the data dir {home}: {exc.strerror}") from None
    if not (home / "config.toml").exists():
        Config(home=home, model=model, train=train).save()
    cfg = load_config(home)
    return cfg.model_copy(update={"model": model, "train": cfg.train.model_copy(update=chosen)})
