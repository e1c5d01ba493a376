"""Configuration: ``config.toml`` in the data dir, overridden by environment variables.

Resolution order (later wins): built-in defaults, ``$RLFLEET_HOME/config.toml``, env vars
(``REDIS_URL``, ``DATABASE_URL``, ``RLFLEET_MODEL``, ``RLFLEET_THRESHOLD``, ``RLFLEET_PRESET``), then
explicit CLI flags. Secrets never live here: they are read from env or a 0600 file (see :mod:`secrets_file`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError
from .events import PLATFORMS
from .scopes import Scope, lineage, scope_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

Preset = Literal["careful", "balanced", "aggressive"]
DEFAULT_MODEL = "smollm2-135m"


def data_dir() -> Path:
    return Path(os.environ.get("RLFLEET_HOME") or Path.home() / ".rlfleet").expanduser()


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    preset: Preset = "balanced"
    # Whose adapter a rating trains (shared/scopes.py, docs/scopes.md): "shared", one for everyone;
    # "person", each rater their own; "channel", each conversation its own. Per platform and channel:
    # [bots.<platform>] scope and channel_scopes.
    scope: Scope = "shared"
    # Where a scope's adapter starts: "base", the base model; "shared", the team's current adapter (a
    # scope with no version of its own is answered by it, and its first run trains on top of a copy).
    scope_parent: Literal["base", "shared"] = "base"
    threshold: int = Field(32, ge=1, le=100_000, description="pending ratings that start a run")
    max_ratings: int = Field(512, ge=1, description="cap on ratings one run consumes")
    # Earlier ratings a run trains on again so that it does not forget them (worker/replay.py), as a
    # fraction of its own fresh training ratings; 0: none. Off by default until the forgetting
    # benchmark (bench.learning --then) shows it is worth its training time (bench/RESULTS.md).
    replay: float = Field(0.0, ge=0, le=4)
    # The evaluation gate (worker/gate.py): held-out ratings a candidate must not do worse on.
    gate: bool = True
    holdout_frac: float = Field(0.15, ge=0.0, le=0.5)
    min_holdout: int = Field(4, ge=1, le=1000)
    # KL cap (nats/token) for a candidate whose held-out ratings are all good or all bad (worker/gate.py)
    gate_one_class_kl: float = Field(0.1, gt=0, le=10)
    # A one-class held-out set whose ratings came with words (a 👎's reason or comment) gets its other
    # side from the hindsight teacher reading them: a candidate that came closer to that teacher on them,
    # beyond noise, is held to the usual KL cap instead (worker/gate.py).
    gate_hints: bool = True
    # When the gate refuses a run's version, judge the adapter as it was halfway through the run (after
    # half the optimizer steps) by the same gate and serve that if it passes: a run that overshot
    # still delivers the step it could take safely (docs/objective.md, "The gate").
    fallback: bool = True
    # The training worker loads the model when it starts, not inside the first run: the load (20-35 s
    # on a CPU for the default model) overlaps the minutes it takes to collect the first ratings.
    # false: load on the first run (memory is held only once training has happened).
    preload: bool = True
    # While it waits the training worker does what the next run would do first, under the version
    # being served (worker/idle_work.py): the earlier and pending ratings' features, the answers it
    # explores, the base's log-probs of them, the base's answers the gate samples on the held-out
    # prompts. A run then spends its time on the last ratings and its training. false: each run does
    # it all.
    idle_features: bool = True
    # The training worker's niceness (the scheduler's, 0-19): it gives way to the chat, the bots and the
    # responder on the cores they share, and takes them all when they are idle. On a small CPU an answer
    # asked for while a run trains is otherwise slowed several times over (bench.answer_while_training).
    # 0: the same priority as everything else.
    nice: int = Field(10, ge=0, le=19)
    # The training worker's malloc (shared/allocator.py): "auto" restarts it once, in place, with
    # mimalloc preloaded (the train extra's wheel on Linux; else a system jemalloc or mimalloc), which
    # keeps the step's large freed tensors for the next instead of faulting every page in again: a lower
    # peak, and faster steps where those tensors are much of a step (bench.train_step's ours-glibc).
    # "system": glibc's malloc, as the process starts.
    allocator: Literal["auto", "system"] = "auto"
    # "auto": CUDA if torch sees one, else CPU. "mlx": the MLX trainer (Apple Silicon; pip install -e '.[mlx]').
    device: Literal["auto", "cpu", "cuda", "mps", "mlx"] = "auto"
    # The forward passes' precision (docs/objective.md, "Precision"): "auto" is bf16 on a GPU or CPU
    # that does bf16 natively (about twice the fp32 rate there), else fp32. The log-probs and the loss
    # stay fp32 either way. MLX trains in fp32.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Explicit overrides of the preset's values; None = the preset decides.
    lr: float | None = Field(None, gt=0, lt=1)
    steps: int | None = Field(None, ge=1, le=10_000)
    rank: int | None = Field(None, ge=1, le=512)
    beta: float | None = Field(None, ge=0)
    # The KL anchor compares the base's K likeliest next tokens and the rest (docs/objective.md);
    # 0: only the answer's own token. None: the preset's.
    kl_top_k: int | None = Field(None, ge=0, le=1024)
    # The weight of the unlikelihood term on the answers the policy loops in while it trains
    # (docs/objective.md); 0: off. None: the preset's.
    unlikelihood: float | None = Field(None, ge=0, le=100)
    # The weight of a term that holds the trained policy's next-token entropy on the rated answers at
    # or below the base's (docs/objective.md); 0: off. None: the preset's.
    entropy_hinge: float | None = Field(None, ge=0, le=100)
    seq_band: tuple[float, float] | None = None
    max_tokens: int = Field(1024, ge=16, description="prompt+response tokens kept per sample")
    # Padded tokens per micro-batch (gradients accumulate to the same step either way). None: 512 on a
    # CPU, where a smaller one costs no speed and a quarter of the memory (bench/RESULTS.md), else 2048.
    micro_batch_tokens: int | None = Field(None, ge=64)
    # Micro-batches a pass runs at once, each on its own thread with its share of the cores (the
    # torch trainer; worker/training/parallel.py). None: two on a CPU with two threads or more and
    # the memory to spare, where short answers leave a lone pass too little work per thread
    # (bench/RESULTS.md), else one (a GPU: one). Each one in flight holds its own activations.
    parallel_batches: int | None = Field(None, ge=1, le=64)
    seed: int = 0
    # The training loss; the alternatives exist for the learning benchmark's comparison.
    objective: Literal["mispo", "soft", "reinforce"] = "mispo"
    # How a rating becomes an advantage (docs/objective.md): "ema" against the reward EMA, "asymmetric"
    # against just below the run's mean reward with a bounded push from each 👎.
    advantage: Literal["ema", "asymmetric"] = "ema"
    # Class-balanced advantages (docs/objective.md): the rarer of liked and disliked answers in a run
    # weighted up, by at most this factor, until both pull as hard in total; 0 or 1: off. None: the
    # preset's.
    balance: float | None = Field(None, ge=0, le=64)
    # A 👎's push fades once its answer has become this many nats per token less likely than under the
    # base (docs/objective.md); 0: off. None: the preset's.
    neg_fade: float | None = Field(None, ge=0, le=10)
    # Exploration (docs/objective.md, "The reward model"): answers sampled per prompt from the run's
    # starting policy and scored by the user's reward model, for up to explore_prompts of the run's
    # rated prompts, when the model's cross-validated AUC reaches reward_model_min_auc. 0: off. On by
    # default with the earlier endings below: what lets a taste the model rarely shows be learned
    # (bench/RESULTS.md, "exploration and earlier endings as the default").
    explore: int = Field(4, ge=0, le=64)
    explore_prompts: int = Field(16, ge=1, le=1024)
    explore_max_new_tokens: int = Field(64, ge=1, le=4096)
    explore_weight: float = Field(0.5, ge=0, le=4)
    # Each explored answer's best earlier ending (docs/objective.md, "Exploration"): the answer cut at
    # one of its first explore_cuts sentence ends, added beside it where the reward model scores it
    # higher. 0: off.
    explore_cuts: int = Field(2, ge=0, le=8)
    # The explored answers train in this many minibatches of whole prompt groups, one per optimizer
    # step in turn, the ratings in every step (docs/objective.md, "Exploration"): each explored answer
    # then costs a run steps/explore_minibatches passes instead of one per step. 1: all in every step.
    explore_minibatches: int = Field(4, ge=1, le=64)
    reward_model_min_auc: float = Field(0.75, ge=0.5, le=1)
    # Hindsight distillation (docs/objective.md, "Hindsight"): a rating with words (a comment or a
    # one-click reason) also trains the policy toward a teacher that reads those words as a hint, at
    # every position of the rated answer; the term's weight beside the policy gradient. 0: off. 2: the
    # weight that taught the content taste most and kept the length taste where 1 had it
    # (bench/RESULTS.md, "the hindsight term's weight" sections).
    hindsight: float = Field(2.0, ge=0, le=100)
    # The teacher's K likeliest next tokens the student is pulled toward (and one bin for the rest).
    hindsight_top_k: int = Field(32, ge=1, le=1024)
    # A rated answer is taught only where the teacher moves it in its rating's direction by more than
    # this (mean nats per token: less likely for a 👎, more for a 👍): a hint the teacher cannot read
    # teaches nothing, and noise would.
    hindsight_min_gap: float = Field(0.0, ge=-10, le=10)
    # A stronger teacher that shares the policy's tokenizer (a local folder or a hub id); None: the
    # base model itself, adapter off, with the hint in its context.
    teacher: str | None = Field(None, min_length=1, max_length=1000)
    # The teacher also answers each prompt with words again, under them; where the reward model
    # (reward_model_min_auc) scores that answer above the rated one, it trains as a liked answer
    # (docs/objective.md, "Hindsight"). Off by default: not measured yet (bench/RESULTS.md, "hindsight from
    # the user's words").
    rewrite: bool = False


class ChatSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(200, ge=1, le=8192)
    temperature: float = Field(0.7, ge=0, le=5)
    top_p: float = Field(0.9, gt=0, le=1)
    system_prompt: str | None = None
    # What draws tokens, the chat's answers and the answers a training run samples from saved weights
    # (exploration, the gate's): llama.cpp's kernels on the GGUF file where it can run (a GGUF model
    # on a CPU with llama-cpp-python installed), else torch; "llama.cpp" makes its absence an error,
    # "torch" never uses it.
    engine: Literal["auto", "torch", "llama.cpp"] = "auto"


class BotSettings(BaseModel):
    """One platform's bot (who may do what: docs/ingress.md). Ids are the platform's own user ids
    (Teams: the AAD object id)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    # The token: from this env var, else from this file (which must be mode 0600).
    token_env: str
    token_file: Path | None = None
    raters: list[str] = Field(default_factory=list, description="may rate answers given to others")
    admins: list[str] = Field(default_factory=list,
                              description="may /rl train, rollback, reset, pause, resume (off when empty)")
    buttons: bool = True  # good/bad buttons under each answer
    # Whose adapter a rating here trains (shared/scopes.py, docs/scopes.md): None = train.scope; per
    # channel / chat id, channel_scopes overrides both.
    scope: Scope | None = None
    channel_scopes: dict[str, Scope] = Field(default_factory=dict)
    # Where it answers: these channel / chat ids only; empty = DMs and any channel it is added to.
    channels: list[str] = Field(default_factory=list)
    api_base: str | None = None  # the platform's API base URL (local Bot API server, GovSlack, test fakes)
    http: bool = False  # serve an HTTP endpoint instead of a socket / polling connection
    host: str = "127.0.0.1"
    port: int = Field(3000, ge=0, le=65535)
    context_messages: int = Field(8, ge=0, le=50, description="earlier thread messages sent with a prompt")
    # Platform down, dropping the connection or answering errors: wait this long, doubling per failure
    # in a row up to retry_max_s, and try again (bots/supervisor.py).
    retry_min_s: float = Field(1.0, gt=0, le=600)
    retry_max_s: float = Field(60.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _retry_bounds(self) -> BotSettings:
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be at least retry_min_s")
        return self


class SlackSettings(BotSettings):
    token_env: str = "SLACK_BOT_TOKEN"
    signing_secret_env: str = "SLACK_SIGNING_SECRET"  # HTTP mode
    signing_secret_file: Path | None = None
    app_token_env: str = "SLACK_APP_TOKEN"  # Socket Mode (the default: no public URL needed)
    app_token_file: Path | None = None


class DiscordSettings(BotSettings):
    token_env: str = "DISCORD_BOT_TOKEN"
    sync_commands: bool = True  # register /rl with Discord on start
    # The gateway websocket: this URL, else the one GET {api_base}/gateway/bot names when api_base is
    # set, else Discord's public gateway.
    gateway_url: str | None = None


class TelegramSettings(BotSettings):
    token_env: str = "TELEGRAM_BOT_TOKEN"
    webhook_url: str | None = None  # the public URL Telegram posts to (HTTP mode); None: long polling
    webhook_secret_env: str = "TELEGRAM_WEBHOOK_SECRET"
    webhook_secret_file: Path | None = None


class TeamsSettings(BotSettings):
    token_env: str = "TEAMS_APP_PASSWORD"  # the app password; Bot Framework auth is on when app_id is set
    app_id: str | None = None
    tenant_id: str | None = None
    port: int = Field(3978, ge=0, le=65535)


class BotsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slack: SlackSettings = Field(default_factory=SlackSettings)
    discord: DiscordSettings = Field(default_factory=DiscordSettings)
    telegram: TelegramSettings = Field(default_factory=TelegramSettings)
    teams: TeamsSettings = Field(default_factory=TeamsSettings)

    def get(self, platform: str) -> BotSettings | None:
        return getattr(self, platform, None) if platform in PLATFORMS else None


class ResponderSettings(BaseModel):
    """What answers for the bots: any OpenAI-compatible chat-completions server (ours: `rlfleet serve`)."""

    model_config = ConfigDict(extra="forbid")
    url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # the name to ask for; None: the server's first model
    api_key_env: str = "RLFLEET_RESPONDER_KEY"  # sent as a bearer token when set (vLLM --api-key, ...)
    timeout: float = Field(120.0, gt=0)
    logprobs: bool = True  # ask for token log-probs (recorded as the behaviour policy when ours answers)


class BridgeKey(BaseModel):
    """A further key for gateways: requests it signs act as ``id`` (the data dir's secret file is the
    key ``local``, the local user's, which is an admin key)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    secret_env: str | None = None
    secret_file: Path | None = None
    admin: bool = False


class BridgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    rate_limit: int = Field(50, ge=1, description="requests per second per key")
    keys: list[BridgeKey] = Field(default_factory=list)
    agent_admin: bool = False  # /rl train, rollback, reset, pause, resume typed in a coding agent

    @model_validator(mode="after")
    def _distinct_key_ids(self) -> BridgeSettings:
        # A key's id is who its requests act as: a second key of the same id would take the first one's
        # place unseen, and ``local`` is the data dir's own key (its secret file), an admin key always.
        ids = [k.id for k in self.keys]
        if "local" in ids:
            raise ValueError("bridge key id 'local' is the data dir's own key (its secret file): "
                             "give the [[bridge.keys]] entry another id")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"bridge key id {twice[0]!r} is given to more than one [[bridge.keys]] entry: "
                             "each key needs an id of its own")
        return self


class WebSettings(BaseModel):
    """`rlfleet web`: the browser app for the data dir's owner (docs/web.md)."""

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"  # anything but loopback: put TLS in front (the login travels in a cookie)
    port: int = Field(8790, ge=0, le=65535)
    token_file: Path | None = None  # default: <data dir>/web-token, made 0600 on first start
    session_hours: float = Field(12.0, gt=0, le=24 * 30)  # how long a login lasts


class PushTarget(BaseModel):
    """An inference server that gets every newly served adapter (worker/push.py)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # in status and `rlfleet push`
    kind: Literal["vllm", "ollama", "lmstudio", "manual"]
    url: str | None = None  # vLLM http://127.0.0.1:8000, Ollama http://127.0.0.1:11434
    # vLLM: the adapter name clients ask for (default "rlfleet"); Ollama: the model made (default "<base>-rlfleet")
    model: str | None = None
    base: str | None = None  # Ollama: the base model as Ollama names it (FROM); never modified
    adapter_root: str | None = None  # vLLM: where that server sees our adapters folder (a container mount)
    api_key_env: str | None = None  # vLLM --api-key, sent as a bearer token
    llama_cpp: Path | None = None  # a llama.cpp checkout: its converters make GGUF files for Ollama
    timeout: float = Field(120.0, gt=0)


class Allowlists(BaseModel):
    model_config = ConfigDict(frozen=True)
    raters: frozenset[str] = frozenset()
    admins: frozenset[str] = frozenset()


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = DEFAULT_MODEL
    redis_url: str | None = None
    database_url: str | None = None
    train: TrainSettings = Field(default_factory=TrainSettings)
    chat: ChatSettings = Field(default_factory=ChatSettings)
    bots: BotsSettings = Field(default_factory=BotsSettings)
    responder: ResponderSettings = Field(default_factory=ResponderSettings)
    push: list[PushTarget] = Field(default_factory=list)
    bridge: BridgeSettings = Field(default_factory=BridgeSettings)
    web: WebSettings = Field(default_factory=WebSettings)
    allow_remote_push: bool = False  # push targets must be on this machine (loopback) unless this is set

    def scope_for(self, source: str, conversation: str | None) -> Scope:
        """The scope of a rating from ``source`` on an answer in ``conversation``: the channel's, the
        platform's, else ``train.scope``."""
        bot = self.bots.get(source)
        if bot is None:  # a one-person front end (the terminal, the web app, an agent): its sessions are
            return "person" if self.train.scope == "channel" else self.train.scope  # not channels
        if conversation is not None and conversation in bot.channel_scopes:
            return bot.channel_scopes[conversation]
        return bot.scope if bot.scope is not None else self.train.scope

    def scope_key_of(self, source: str, actor: str | None, conversation: str | None) -> str:
        """The scope key (shared/scopes.py) of ``actor`` on ``source`` in ``conversation``: whose
        adapter their ratings train and their answers come from."""
        return scope_key(self.scope_for(source, conversation), source, actor, conversation)

    def lineage_of(self, slug: str, source: str, actor: str, conversation: str | None) -> str:
        """The lineage (shared/scopes.py) a rating by ``actor`` from ``source`` on an answer in
        ``conversation`` trains, for model ``slug``."""
        return lineage(slug, self.scope_key_of(source, actor, conversation))

    @property
    def scoped(self) -> bool:
        """Whether any rating may train an adapter other than the shared one."""
        chosen = [self.train.scope]
        for bot in filter(None, (self.bots.get(p) for p in PLATFORMS)):
            chosen += [bot.scope or "shared", *bot.channel_scopes.values()]
        return any(scope != "shared" for scope in chosen)

    def allowlists(self, source: str) -> Allowlists:
        """Who besides a capture's owner may rate, and who may run admin commands, for one ingress."""
        bot = self.bots.get(source)
        if bot is None:
            return Allowlists()
        return Allowlists(raters=frozenset(bot.raters), admins=frozenset(bot.admins))

    home: Path = Field(default_factory=data_dir, exclude=True)

    @property
    def config_path(self) -> Path:
        return self.home / "config.toml"

    def _on_disk(self) -> dict:
        """What config.toml holds now ({} when there is none or it does not parse)."""
        try:
            return tomllib.loads(self.config_path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            return {}

    @property
    def secret_path(self) -> Path:
        return self.home / "secret"

    @property
    def web_token_path(self) -> Path:
        return self.web.token_file or self.home / "web-token"

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'rlfleet.db'}"

    @property
    def adapters_root(self) -> Path:
        return self.home / "adapters"

    @property
    def redis_dir(self) -> Path:
        return self.home / "redis"

    def save(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        data = self.model_dump(mode="json", exclude_none=True, exclude={"home"})
        # Connection URLs may embed passwords: one that came from the environment stays there (the file
        # keeps what it had), so only a URL the user wrote in the file is ever on disk.
        on_disk = self._on_disk()
        for env, key in URL_ENV.items():
            if os.environ.get(env) and data.get(key) == os.environ[env]:
                if key in on_disk:
                    data[key] = on_disk[key]
                else:
                    data.pop(key, None)
        tmp = self.config_path.with_suffix(".toml.tmp")
        tmp.unlink(missing_ok=True)
        # 0600 as the secret file: a URL written in it may hold a password
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as fh:
            fh.write(tomli_w.dumps(data))
        os.replace(tmp, self.config_path)
        return self.config_path


URL_ENV = {"REDIS_URL": "redis_url", "DATABASE_URL": "database_url"}  # env vars that override a setting


def load_config(home: Path | None = None, **overrides: object) -> Config:
    """Load the config for ``home`` (default: the data dir), apply env vars and ``overrides``."""
    home = (home or data_dir()).expanduser()
    raw: dict = {}
    path = home / "config.toml"
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML ({exc}); fix it or delete it and run `rlfleet init`") from None
    for env, key in {**URL_ENV, "RLFLEET_MODEL": "model"}.items():
        if os.environ.get(env):
            raw[key] = os.environ[env]
    train = dict(raw.get("train", {}))
    if os.environ.get("RLFLEET_THRESHOLD"):
        train["threshold"] = os.environ["RLFLEET_THRESHOLD"]
    if os.environ.get("RLFLEET_PRESET"):
        train["preset"] = os.environ["RLFLEET_PRESET"]
    for key in ("threshold", "preset"):
        if overrides.get(key) is not None:
            train[key] = overrides.pop(key)
    raw["train"] = train
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Config(home=home, **raw)
    except ValidationError as exc:
        from .events import describe_validation_error

        msg = describe_validation_error(exc, "bad config value")
        raise ConfigError(f"{msg} (in {path} or the environment)") from None


def redact_url(url: str) -> str:
    """The URL with its credentials masked, for messages and logs."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
