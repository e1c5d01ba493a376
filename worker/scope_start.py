"""Where a scope's adapter starts when `train.scope_parent = "shared"`: a copy of the team's current
version, as the scope's first version, which its first run then trains on top of (docs/scopes.md)."""

from __future__ import annotations

import shutil

from rlfleet.shared import scopes
from rlfleet.shared.registry import META_FILE, AdapterRegistry

from .context import Context


def start_from_shared(ctx: Context) -> str | None:
    """The shared adapter's current version copied into ``ctx``'s scope as its first version, served
    at once (the scope was answered by it already); None when the shared lineage serves the base, or
    when this is not a scope's first run (a scope rolled back to its base model stays there)."""
    if not scopes.is_scoped(ctx.slug) or ctx.cfg.train.scope_parent != "shared" or ctx.registry.versions():
        return None
    shared = AdapterRegistry(ctx.cfg.adapters_root, scopes.split(ctx.slug)[0])
    source = shared.current()
    if source is None:
        return None
    version = ctx.registry.next_version()
    staging = ctx.registry.staging(version)
    try:
        for f in shared.path(source).iterdir():
            if f.is_file() and f.name != META_FILE:
                shutil.copy2(f, staging / f.name)
        copied = {"copied_from": f"{shared.slug} {source}"}
        ctx.registry.commit(staging, version, {"version": version, "parent": None, **copied})
    except BaseException:
        ctx.registry.discard(staging)
        raise
    ctx.store.add_copied_version(ctx.slug, version, copied)
    ctx.registry.set_current(version)
    return version
