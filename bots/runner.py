"""`rlfleet bot PLATFORM`: one platform's bot in the foreground, on the shared queue and store."""

from __future__ import annotations

import asyncio
import importlib
import logging

from rlfleet.shared.config import BotSettings, Config
from rlfleet.shared.errors import BadInput, ConfigError
from rlfleet.shared.events import PLATFORMS
from rlfleet.shared.queue import queue_for
from rlfleet.shared.secrets_file import read_secret, redact_in_logs
from rlfleet.shared.store import Store

from .core import BotCore

log = logging.getLogger(__name__)


def platform_module(platform: str):
    if platform not in PLATFORMS:
        raise BadInput(f"unknown platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    try:
        return importlib.import_module(f"rlfleet.bots.{platform}")
    except ImportError as exc:
        raise ConfigError(f"the {platform} bot needs its SDK ({exc.name}): pip install -e '.[bots]'") from None


def _secrets(settings: BotSettings) -> list[str]:
    """Every secret this bot's settings point at (env vars or files), to keep them out of the logs."""
    found = []
    for name in ("token", "signing_secret", "app_token", "webhook_secret"):
        env, file = getattr(settings, f"{name}_env", None), getattr(settings, f"{name}_file", None)
        value = read_secret(env, file, name, required=False) if env or file else None
        if value:
            found.append(value)
    return found


def run_bot(platform: str, cfg: Config, **opts: object) -> None:
    """Serve ``platform`` until interrupted. ``opts``: ``http``, ``host``, ``port`` where it has them."""
    module = platform_module(platform)
    redact_in_logs(*_secrets(cfg.bots.get(platform)))  # type: ignore[arg-type]
    with queue_for(cfg) as handle:
        core = BotCore(platform, cfg, handle, Store(cfg.db_url))  # type: ignore[arg-type]
        log.info("%s bot: answering through %s", platform, cfg.responder.url)
        asyncio.run(module.run(core, cfg, **{k: v for k, v in opts.items() if v is not None}))


def enabled_bots(cfg: Config) -> list[str]:
    return [p for p in PLATFORMS if cfg.bots.get(p).enabled]  # type: ignore[union-attr]
