"""`rlfleet bot PLATFORM`: one platform's bot in the foreground, on the shared queue and store."""

from __future__ import annotations

import asyncio
import importlib
import logging

from rlfleet.shared.config import Config
from rlfleet.shared.errors import BadInput, ConfigError
from rlfleet.shared.events import PLATFORMS
from rlfleet.shared.queue import queue_for
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


def run_bot(platform: str, cfg: Config, **opts: object) -> None:
    """Serve ``platform`` until interrupted. ``opts``: ``http``, ``host``, ``port`` where it has them."""
    module = platform_module(platform)
    with queue_for(cfg) as handle:
        core = BotCore(platform, cfg, handle, Store(cfg.db_url))  # type: ignore[arg-type]
        log.info("%s bot: answering through %s", platform, cfg.responder.url)
        asyncio.run(module.run(core, cfg, **{k: v for k, v in opts.items() if v is not None}))


def enabled_bots(cfg: Config) -> list[str]:
    return [p for p in PLATFORMS if cfg.bots.get(p).enabled]  # type: ignore[union-attr]
