"""``rlfleet status``: the status object, as a table or as JSON."""

from __future__ import annotations

import json

from rlfleet.shared.queue import queue_for
from rlfleet.shared.status import status_dict
from rlfleet.shared.status_view import render_status

from .app import JsonOpt, ScopeOpt, app, command_config, known_scope, out


@app.command()
def status(as_json: JsonOpt = False, scope: ScopeOpt = None) -> None:
    """Ratings, baseline, adapter versions, training state, queue and workers (and each scope's
    adapter: --scope for one scope's whole status)."""
    cfg = command_config(read_only=True)
    with queue_for(cfg) as q:
        st = status_dict(cfg, q, known_scope(cfg, scope))
    if as_json:
        out.print_json(json.dumps(st, default=str))
    else:
        out.print(render_status(st))
