"""Does the served adapter behave the same whichever engine draws? One data dir's served version (its
``CURRENT``, or the base), its held-out answers drawn by torch and by llama.cpp (``chat.engine``) with
the same prompts, sampling and seeds as `bench.learning`'s checkpoints, scored by the same preference:
the rate each engine shows a user, side by side, with 95 % Wilson intervals.

    python -m bench.engine_fidelity --home DIR --preference short:34 [--heldout 16 --samples 4]
"""

from __future__ import annotations

import time
from pathlib import Path

from .record import markdown_table, output_options, parser, publish


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.engine_fidelity", __doc__)
    ap.add_argument("--home", required=True, type=Path, help="a data dir (bench.learning --home keeps one)")
    ap.add_argument("--preference", required=True, help="a named preference, NAME or NAME:ARG")
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts (default 16)")
    ap.add_argument("--samples", type=int, default=4, help="answers per prompt (default 4)")
    ap.add_argument("--batch", type=int, default=32, help="answers per generate call (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="default 48, as bench.learning")
    ap.add_argument("--engines", default="torch,llama.cpp", help="comma list (default torch,llama.cpp)")
    ap.add_argument("--device", default="cpu",
                    help="where torch draws and scores: cpu (default), cuda, mps or auto (llama.cpp draws on the CPU)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads for torch and llama.cpp (default: torch's choice)")
    output_options(ap)
    args = ap.parse_args(argv)
    if min(args.heldout, args.samples, args.batch, args.max_new_tokens) < 1 or args.threads < 0:
        ap.error("--heldout, --samples, --batch and --max-new-tokens must be at least 1, --threads at least 0")
    if args.device not in ("cpu", "cuda", "mps", "auto"):
        ap.error(f"--device {args.device!r}: cpu, cuda, mps or auto")
    if not (args.home / "config.toml").is_file():
        ap.error(f"{args.home} is not a data dir (no config.toml); bench.learning --home keeps one")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    from rlfleet.shared.llamacpp_engine import ENGINES

    if not engines or any(e not in ENGINES for e in engines):
        ap.error(f"--engines takes a comma list of {', '.join(ENGINES)}")

    import torch

    from rlfleet.shared.config import load_config
    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.responder import LocalResponder

    from .learning.metrics import preferred_rate, repeat_share
    from .learning.raters import preference
    from .learning.simulate import heldout_prompts, sample_in_batches

    if args.threads:  # llama.cpp takes torch's thread count
        torch.set_num_threads(args.threads)
    cfg = load_config(args.home)
    ref = resolve_model(cfg.model)
    device = pick_device(args.device)
    registry = AdapterRegistry(cfg.adapters_root, ref.slug)
    try:
        pref = preference(args.preference)
    except ValueError as exc:
        ap.error(str(exc))
    rows = [p for p in heldout_prompts(args.heldout) for _ in range(args.samples)]
    figures: dict = {"home": str(args.home), "preference": args.preference, "version": registry.current(),
                     "answers": len(rows), "device": device, "threads": torch.get_num_threads(), "engines": {}}
    for engine in engines:
        t0 = time.perf_counter()
        responder = LocalResponder(ref, registry.dir, device=device, max_new_tokens=args.max_new_tokens,
                                   temperature=cfg.chat.temperature, top_p=cfg.chat.top_p, engine=engine)
        got = sample_in_batches(responder, [[{"role": "user", "content": p}] for p in rows], args.batch)
        rate, ci, n = preferred_rate([pref.rate(p, a.text) for p, a in zip(rows, got, strict=True)])
        figures["engines"][engine] = {
            "drawn_by": responder.engine, "version": responder.active_version, "rate": rate, "ci95": list(ci),
            "judged": n, "repeat": repeat_share([a.token_ids for a in got], responder.tokenizer.eos_token_id),
            "words": sum(len(a.text.split()) for a in got) / len(got), "seconds": time.perf_counter() - t0,
        }
    table = markdown_table(
        ["engine", "drew", "version", "rate [95 %]", "repeated trigrams", "words per answer"],
        [[e, f["drawn_by"], f["version"] or "base", f"{f['rate']:.2f} [{f['ci95'][0]:.2f}, {f['ci95'][1]:.2f}]",
          f"{f['repeat']:.1%}", f"{f['words']:.0f}"] for e, f in figures["engines"].items()])
    publish(figures, table, args, f"`bench.engine_fidelity` · {ref.spec} · {args.preference} · {device}, "
                                  f"{figures['threads']} threads")
    return figures


if __name__ == "__main__":
    main()
