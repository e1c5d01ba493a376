"""What many per-person adapters cost the responder: memory per loaded adapter, the time to switch
between scopes, and answers per second with requests spread over scopes against one scope.

`--scopes` scopes (`person:bench:<i>`) each get an adapter of the trainer's shape (rank 16 on every
linear layer, the presets' rank) with random weights, written where a scope's run writes its version
(shared/scopes.py), and one `LocalResponder` on the model serves them all (docs/scopes.md):

* memory: the process's resident memory with no scope adapter loaded and then with each of
  `--loaded` adapters loaded (one answer per scope loads it), per adapter;
* switching: the responder's own selection of a scope's adapter before an answer (reading its
  `CURRENT`, checking its weights, making it the active one): for an adapter already loaded
  (round robin over `--loaded` scopes, capacity above them) and from disk (round robin over more
  scopes than the capacity, so every request loads one and lets the least recently used go); the
  issue's targets are under 20 ms loaded and under 300 ms from disk on a CPU;
* answers per second: `--requests` answers of `--new-tokens` tokens, every one from one scope's
  adapter, against the same requests spread round robin over the loaded scopes (one answer at a
  time each, in alternation so that the machine's noise falls on both); the figure is the ratio.

* queue fairness: `--neighbours` busy scopes queue a run again the moment their last one ends; a
  quiet scope reaches its threshold at each point of their cycle in turn; the figure is the most
  runs that start before the quiet scope's own (through the real trigger, store and queue on an
  embedded Redis; the runs themselves are taken from the queue in order and ended at once, since
  the figure is the queue's order, not a run's length: multiply by a run's time for seconds).

    python -m bench.scopes [--model smollm2-135m] [--scopes 100] [--loaded 8] [--requests 32] [--neighbours 4]
                           [--threads N] [--json] [--no-record]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .record import markdown_table, output_options, parser, publish


def rss_mib() -> float:
    """This process's resident memory now (Linux: /proc/self/status), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_adapters(ref, root: Path, slug: str, n: int, rank: int, seed: int) -> list[str]:
    """``n`` scopes' v0001 adapters of rank ``rank`` on every linear layer, random weights; their keys."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rlfleet.shared import scopes
    from rlfleet.shared.models import load_model
    from rlfleet.shared.registry import AdapterRegistry

    model = get_peft_model(load_model(ref), LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear"))
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    keys = []
    for i in range(n):
        key = f"person:bench:{i}"
        torch.manual_seed(seed + i)
        with torch.no_grad():
            for p in lora:
                p.normal_(0.0, 0.02)
        registry = AdapterRegistry(root, scopes.lineage(slug, key))
        model.save_pretrained(registry.path("v0001"))
        registry.set_current("v0001")
        keys.append(key)
    return keys


def queue_fairness(model: str, neighbours: int) -> dict:
    """The most training runs that start between a quiet scope's threshold and its own run, with
    ``neighbours`` busy scopes, over every point of their cycle (see the module's docstring)."""
    from rq import Queue

    from rlfleet.shared import scopes
    from rlfleet.shared.config import Config, TrainSettings
    from rlfleet.shared.events import Capture, Rating
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import TRAIN_QUEUE, open_queue, train_lock_key
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.store import Store
    from rlfleet.worker.context import Context
    from rlfleet.worker.trigger import maybe_trigger

    home = Path(tempfile.mkdtemp(prefix="bench-scopes-queue-"))
    cfg = Config(home=home, model=model, train=TrainSettings(threshold=2, scope="channel"))
    cfg.save()
    handle = open_queue(cfg)
    slug, store = model_slug(model), Store(cfg.db_url)
    queue = Queue(TRAIN_QUEUE, connection=handle.redis)

    def ctx_of(key: str) -> Context:
        name = scopes.lineage(slug, key)
        return Context(cfg, store, name, AdapterRegistry(cfg.adapters_root, name), 0.0)

    def rate(ctx: Context) -> None:
        for _ in range(2):
            c = Capture(source="slack", owner="U", conversation="c", prompt=[{"role": "user", "content": "q"}],
                        response="a", model=model)
            store.apply_many([c, Rating(source="slack", actor="U", target=c.capture_id, value=1)], ctx.slug)

    def run_head() -> str:
        """The worker takes the queue's first run and ends it; its lineage."""
        job = queue.jobs[0]
        run_id, lineage = job.args
        job.delete()
        store.fail_run(run_id, "bench: ended at once", state="skipped")
        handle.redis.delete(train_lock_key(lineage))
        return lineage

    waits = []
    try:
        busy = [ctx_of(f"channel:slack:busy-{i}") for i in range(neighbours)]
        for offset in range(neighbours + 1):
            quiet = ctx_of(f"channel:slack:quiet-{offset}")
            for b in busy:
                rate(b)
                maybe_trigger(b, handle.redis, force=True)
            for _ in range(offset):  # the busy scopes go round: each run ends and queues again at once
                ended = run_head()
                b = next(b for b in busy if b.slug == ended)
                rate(b)
                maybe_trigger(b, handle.redis, force=True)
            rate(quiet)
            assert (maybe_trigger(quiet, handle.redis) or "").startswith("training run")
            ahead = 0
            while True:
                ended = run_head()
                if ended == quiet.slug:
                    break
                ahead += 1
                b = next(b for b in busy if b.slug == ended)
                rate(b)
                maybe_trigger(b, handle.redis, force=True)
            waits.append(ahead)
            while queue.count:  # the busy scopes' runs left: the next point starts from an empty queue
                run_head()
    finally:
        handle.close()
    return {"neighbours": neighbours, "runs_ahead_max": max(waits), "runs_ahead": waits}


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.scopes", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--scopes", type=int, default=100, help="scopes with an adapter of their own (default 100)")
    ap.add_argument("--loaded", type=int, default=8, help="adapters kept loaded at once (default 8)")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank (default 16, the presets')")
    ap.add_argument("--requests", type=int, default=32, help="answers per side for answers/s (default 32)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens per answer (default 16)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--neighbours", type=int, default=4, help="busy scopes for the queue's fairness (default 4)")
    output_options(ap)
    args = ap.parse_args(argv)
    if args.loaded < 1 or args.scopes <= args.loaded or args.requests < 1 or args.rank < 1:
        ap.error("--loaded and --requests must be at least 1, and --scopes more than --loaded (the disk side "
                 "needs scopes that are not loaded)")

    import torch

    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.shared.responder import LocalResponder

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    ref = resolve_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="bench-scopes-"))
    t0 = time.perf_counter()
    keys = write_adapters(ref, root, ref.slug, args.scopes, args.rank, args.seed)
    written_s = time.perf_counter() - t0
    size_mib = sum(f.stat().st_size for f in (root).rglob("adapter_model.*")) / len(keys) / 2**20

    responder = LocalResponder(ref, root / ref.slug, device=device, max_new_tokens=args.new_tokens,
                               temperature=1.0, top_p=1.0, max_adapters=args.loaded + 1)
    ask = [{"role": "user", "content": "Tell me something about the sea."}]
    responder.answer(ask, seed=0, max_new_tokens=1)  # warm: the shared scope, no adapter loaded
    before = rss_mib()
    for key in keys[:args.loaded]:
        responder.answer(ask, seed=0, max_new_tokens=1, scope=key)
    per_adapter = (rss_mib() - before) / args.loaded

    def select_ms(scope_keys: list[str], rounds: int) -> list[float]:
        out = []
        for i in range(rounds):
            key = scope_keys[i % len(scope_keys)]
            with responder._lock:  # what an answer does first, timed alone
                t = time.perf_counter()
                responder._select(key)
                out.append((time.perf_counter() - t) * 1000)
        return out

    loaded_ms = select_ms(keys[:args.loaded], 4 * args.loaded)
    responder.max_adapters = args.loaded  # from here on every new scope lets the oldest go
    disk_ms = select_ms(keys[args.loaded:], min(len(keys) - args.loaded, 4 * args.loaded))

    responder.max_adapters = args.loaded + 1
    for key in keys[:args.loaded]:
        responder.answer(ask, seed=0, max_new_tokens=1, scope=key)  # loaded again for the answers/s part
    sides: dict[str, float] = {"one scope": 0.0, "spread": 0.0}
    for i in range(args.requests):
        for side in (("one scope", "spread") if i % 2 == 0 else ("spread", "one scope")):
            scope = keys[0] if side == "one scope" else keys[i % args.loaded]
            t = time.perf_counter()
            responder.answer(ask, seed=i, scope=scope)
            sides[side] += time.perf_counter() - t
    aps = {side: args.requests / s for side, s in sides.items()}
    fair = queue_fairness(args.model, args.neighbours)

    figures = {
        "model": args.model, "device": device, "scopes": args.scopes, "loaded": args.loaded, "rank": args.rank,
        "adapter_file_mib": size_mib, "written_s": written_s, "rss_before_mib": before,
        "rss_per_adapter_mib": per_adapter,
        "switch_loaded_ms_median": statistics.median(loaded_ms), "switch_loaded_ms_max": max(loaded_ms),
        "switch_disk_ms_median": statistics.median(disk_ms), "switch_disk_ms_max": max(disk_ms),
        "aps_one_scope": aps["one scope"], "aps_spread": aps["spread"],
        "spread_ratio": aps["spread"] / aps["one scope"],
        "queue_neighbours": args.neighbours, "queue_runs_ahead_max": fair["runs_ahead_max"],
        "queue_runs_ahead": fair["runs_ahead"],
    }
    rows = [
        ["resident memory, no scope adapter loaded", f"{before:,.0f} MiB", ""],
        ["per loaded adapter (file)", f"{per_adapter:.1f} MiB ({size_mib:.1f} MiB)", ""],
        ["switch to a loaded adapter (median / max)",
         f"{figures['switch_loaded_ms_median']:.2f} / {max(loaded_ms):.2f} ms", "target < 20 ms"],
        ["switch to one from disk (median / max)",
         f"{figures['switch_disk_ms_median']:.0f} / {max(disk_ms):.0f} ms", "target < 300 ms"],
        ["answers/s, one scope", f"{aps['one scope']:.2f}", ""],
        [f"answers/s, spread over {args.loaded} scopes", f"{aps['spread']:.2f}",
         f"**{figures['spread_ratio']:.2f}×** of one scope"],
        [f"runs ahead of a quiet scope, {args.neighbours} busy neighbours (most)", str(fair["runs_ahead_max"]),
         f"over {len(fair['runs_ahead'])} points of their cycle: {fair['runs_ahead']}"],
    ]
    text = markdown_table(["figure", "measured", ""], rows) + (
        f"\n\n{args.scopes} scope adapters (rank {args.rank}, every linear layer) written in {written_s:.0f} s; "
        f"{args.requests} answers of up to {args.new_tokens} tokens per side.")
    publish(figures, text, args, f"`bench.scopes` · {args.model} · {device} · {args.scopes} scopes · "
                                 f"{args.loaded} loaded")
    return figures


if __name__ == "__main__":
    main()
