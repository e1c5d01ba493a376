"""Training-step throughput and peak memory: our objective vs TRL's KTOTrainer vs a two-copy loop.

Same model, same ratings, same LoRA (rank, alpha, all linear layers), same micro-batch budget and
device; each run is a fresh process (so one run's freed memory cannot hide the next one's peak),
the methods interleaved round by round, medians reported.

* ``ours``: the worker's Trainer (worker/training/): one model, the reference is the base with the
  adapter switched off and is computed once per run; the output head runs on response tokens only.
* ``kto``: TRL's KTOTrainer on the same ratings (bench/learning/kto.py wires it to the same LoRA,
  optimizer and batch budget); its reference is also the adapter switched off, computed every step,
  plus its KL pass over mismatched pairs.
* ``ours-fp32``: ours with ``train.precision = "fp32"``, beside ``ours`` at ``--precision`` (auto:
  bf16 where the GPU or CPU does it natively), so one run shows what bf16 buys.
* ``ours-serial``: ours with ``train.parallel_batches = 1``, one micro-batch at a time on every
  thread, beside ``ours`` (two side by side on a CPU: worker/training/parallel.py), so one run shows
  what that buys.
* ``ours-sdpa``: ours with the model's attention left to SDPA's fused kernel, beside ``ours`` (whose
  CPU bf16 passes stack each key/value head's queries into one product: worker/training/
  grouped_attention.py), so one run shows what that buys.
* ``ours-glibc``: ours on glibc's ``malloc``, beside ``ours`` and the others on ``--allocator`` (auto:
  the mimalloc or jemalloc the training worker preloads, shared/allocator.py), so one run shows
  what that buys. Every row names its process's allocator.
* ``two-copy``: what a plain implementation does: a second, frozen copy of the model as the
  reference, run every step, full-vocabulary logits at every position; the same MIS-PO loss.

Figures: tokens/s of the steady steps (steps 2..N: the first pays one-off costs), tokens/s over the
whole run (setup and our once-per-run reference pass included), and peak memory during the run
(CUDA: the allocator's peak; CPU: the process's peak resident set) in total and above the loaded
base model. "Tokens" are the rated prompt+answer tokens one optimizer step trains on, the same
count for every method.

    python -m bench.train_step --model default                  # the default model, CPU
    python -m bench.train_step --model tiny --rounds 5          # the tests' tiny model
    python -m bench.train_step --model arch:smollm2-135m --device cuda --dtype bf16
    python -m bench.train_step --model default --methods ours --rounds 1 --profile   # where a step goes

``--profile``: one more ``ours`` run whose second optimizer step (a steady one) is recorded with
torch.profiler and summed by family (:func:`families`): the output head's products, the LoRA's, the
other products, attention, vocabulary-wide elementwise work (the log-softmax, entropy and their
gradients), casts and copies, and the rest; seconds of the step and each family's share; then the
operators with the most self time (:func:`top_ops`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .record import output_options, parser, publish

METHODS = ("ours", "ours-fp32", "ours-serial", "ours-sdpa", "ours-glibc", "kto", "two-copy")
# The variants of ours that a row's speed is also given against, by their column's name.
VARIANTS = {"ours-fp32": "ours fp32", "ours-serial": "ours serial", "ours-sdpa": "ours sdpa",
            "ours-glibc": "ours glibc malloc"}
DEFAULT_METHODS = ("ours", "ours-fp32", "kto", "two-copy")  # the other variants of ours on demand


# -- one run, in its own process -------------------------------------------------------------------


def build_trainer(model: str, device: str, dtype: str) -> Any:
    """``tiny`` / ``arch:NAME`` (random-init, byte tokenizer), ``default`` or a model folder/hub id."""
    import torch

    from rlfleet.shared.config import DEFAULT_MODEL
    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.training.torch_backend import Trainer

    from .synthetic import byte_tokenizer, random_model

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if model == "tiny" or model.startswith("arch:"):
        tok = byte_tokenizer()
        arch = "tiny" if model == "tiny" else model.removeprefix("arch:")
        return Trainer.from_model(random_model(arch, tok, device, torch_dtype), tok, device)
    trainer = Trainer(resolve_model(DEFAULT_MODEL if model == "default" else model), device)
    if torch_dtype != torch.float32:
        trainer.base.to(torch_dtype)
    return trainer


class Memory:
    """Peak memory from a reset point: CUDA's allocator peak, or the process's peak RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def current(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _status_kb("VmRSS") * 1024

    def reset(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            # Linux: writing 5 resets the peak-RSS mark (VmHWM) to the current RSS.
            Path("/proc/self/clear_refs").write_text("5")

    def peak(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status_kb("VmHWM") * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def two_copy_run(trainer: Any, samples: list, cfg: Any, on_step: Any) -> None:
    """The plain loop: a frozen second copy as the reference, full logits everywhere, every step."""
    import torch

    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.objective import loss_for
    from rlfleet.worker.training.advantages import run_advantages

    reference = copy.deepcopy(trainer.base)  # the second copy: its memory is part of this method
    encoded = [encode_sample(trainer.tokenizer, s, cfg.max_tokens) for s in samples]
    groups, batches = trainer.batches(encoded, cfg.micro_batch_tokens)
    adv = trainer.vector(run_advantages(samples, None, cfg.pos_weight, cfg.adv_clip))
    loss_fn = loss_for(cfg)

    def logprobs(model: Any, batch: dict) -> torch.Tensor:
        with trainer.autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = lp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=picked.device)
        out[:, 1:] = picked
        return out * batch["response_mask"]

    torch.manual_seed(cfg.seed)
    with trainer.adapter(None, cfg, trainable=True, precision=cfg.precision) as model:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr)
        behaviour: dict[int, torch.Tensor] = {}
        for step in range(cfg.steps):
            opt.zero_grad(set_to_none=True)
            for k, (group, batch) in enumerate(zip(groups, batches, strict=True)):
                with torch.no_grad():
                    ref_lp = logprobs(reference, batch)
                new_lp = logprobs(model, batch)
                if k not in behaviour:
                    behaviour[k] = new_lp.detach()
                out = loss_fn(new_lp, behaviour[k], ref_lp, batch["response_mask"], adv[group])
                (out.loss * len(group) / len(samples)).backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            on_step(step + 1)


def child(args: argparse.Namespace) -> dict:
    import torch

    from rlfleet.shared import allocator
    from rlfleet.shared.models import pick_device
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.presets import preset
    from rlfleet.worker.samples import Progress
    from rlfleet.worker.training import grouped_attention

    from . import synthetic

    torch.set_num_threads(args.threads) if args.threads else None
    device = pick_device(args.device)
    trainer = build_trainer(args.model, device, args.dtype)
    if args.child == "ours-serial":
        trainer.parallel_batches(1)
    if args.child == "ours-sdpa" and trainer.base.config._attn_implementation != "sdpa":
        trainer.base.set_attn_implementation("sdpa")
    samples = synthetic.ratings(args.samples, args.prompt_chars, args.response_chars, seed=0)
    cfg = replace(
        preset("balanced"), steps=args.steps, micro_batch_tokens=args.micro_batch_tokens,
        max_tokens=args.max_tokens, rank=args.rank, alpha=args.rank,
        precision="fp32" if args.child == "ours-fp32" else args.precision,
    )
    encoded = [encode_sample(trainer.tokenizer, s, cfg.max_tokens) for s in samples]
    tokens_per_step = sum(e.length for e in encoded)
    flops_per_step = _step_flops(trainer, [(e.prompt_len, e.n_response) for e in encoded], cfg.rank)

    memory = Memory(device)
    base_bytes = memory.current()
    memory.reset()
    stamps: dict[int, float] = {}

    def on_step(step: int) -> None:
        if memory.cuda:
            torch.cuda.synchronize()
        stamps.setdefault(step, time.perf_counter())

    profiled = StepProfile(device) if args.profile else None

    def on_progress(p: Progress) -> None:
        if p.phase == "training" and p.step >= 1:
            on_step(p.step)
            if profiled is not None:
                profiled.after_step(p.step)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as out:
        if args.child.startswith("ours"):
            trainer.run(samples, None, cfg, None, Path(out) / "a", progress=on_progress)
        elif args.child == "kto":
            from .learning.kto import KtoTrainer

            KtoTrainer(trainer).run(samples, None, cfg, None, Path(out) / "a", progress=on_progress)
        else:
            two_copy_run(trainer, samples, cfg, on_step)
    seconds = time.perf_counter() - started
    if profiled is not None:
        profiled.stop()
    peak = memory.peak()
    precision = "fp32" if args.child == "kto" else trainer.resolved_precision(cfg.precision)
    attention = grouped_attention.used_by(trainer.base, precision)
    steady = [stamps[s] for s in sorted(stamps)]
    if len(steady) < 2:
        raise RuntimeError(f"{args.child}: saw {len(steady)} step(s); need --steps >= 2")
    return {
        "method": args.child,
        "model": args.model,
        "device": device,
        "dtype": args.dtype,
        "precision": precision,
        "attention": attention,
        "allocator": allocator.in_use(),
        "samples": args.samples,
        "tokens_per_step": tokens_per_step,
        "steps": args.steps,
        "step_tokens_per_s": tokens_per_step * (len(steady) - 1) / (steady[-1] - steady[0]),
        "step_model_gflops_per_s": flops_per_step * (len(steady) - 1) / (steady[-1] - steady[0]) / 1e9
        if flops_per_step else None,
        "run_tokens_per_s": tokens_per_step * args.steps / seconds,
        "peak_bytes": peak,
        "base_bytes": base_bytes,
        "above_base_bytes": peak - base_bytes,
        **({"profile": profiled.families(_vocab(trainer), cfg.rank)} if profiled is not None else {}),
    }


class StepProfile:
    """torch.profiler over one optimizer step: started when step 1 reports, stopped when step 2 does
    (the whole run's events would take gigabytes of memory with their shapes)."""

    def __init__(self, device: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.startswith("cuda")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # Every thread's operators: a step's micro-batches run on the trainer's pool threads
        # (worker/training/parallel.py), whose self times then add up to more than the step's wall time.
        import torch

        threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        self.prof = profile(activities=acts, record_shapes=True, experimental_config=threads)
        self.started: float | None = None  # when step 1 reported (None: not yet)
        self.seconds: float | None = None  # the profiled span once it has ended

    def after_step(self, step: int) -> None:
        if step == 1 and self.started is None:
            self.prof.start()
            self.started = time.perf_counter()
        elif step == 2:
            self.stop()

    def stop(self) -> None:
        if self.started is not None and self.seconds is None:
            self.prof.stop()
            self.seconds = time.perf_counter() - self.started

    def families(self, vocab: int | None, rank: int) -> dict[str, Any]:
        if self.seconds is None:
            raise RuntimeError("--profile: the run ended before its second optimizer step")
        events = [(e.key, [list(s) for s in e.input_shapes if s], _self_us(e, self.cuda))
                  for e in self.prof.key_averages(group_by_input_shape=True)]
        return {"step_seconds": self.seconds, "self_seconds": families(events, vocab, rank), "ops": top_ops(events)}


def _self_us(event: Any, cuda: bool) -> float:
    if cuda:
        return float(getattr(event, "self_device_time_total", 0.0) or 0.0)
    return float(event.self_cpu_time_total)


def _vocab(trainer: Any) -> int | None:
    head = trainer.base.get_output_embeddings() if hasattr(trainer.base, "get_output_embeddings") else None
    return int(head.out_features) if head is not None and hasattr(head, "out_features") else None


PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn_matmul"}
COPIES = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"}
# The grouped attention's operators (a CPU bf16 pass: worker/training/grouped_attention.py) where SDPA's
# are one fused call: its batched products (the model's linears and the head multiply 2-D operands),
# its softmax and that softmax's backward, its mask's fill.
GROUPED = {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data", "aten::masked_fill_"}
FAMILIES = ("head products", "LoRA products", "other products", "attention", "vocabulary-wide elementwise",
            "casts and copies", "other")


def families(events: list[tuple[str, list[list[int]], float]], vocab: int | None, rank: int) -> dict[str, float]:
    """Self time (µs in, seconds out) by family, from ``(op name, its input shapes, self µs)`` rows: a
    product with a vocabulary-sized dimension is the head's, one with a ``rank``-sized one the LoRA's;
    SDPA's calls and the grouped attention's operators (:data:`GROUPED`) are attention's; any other op
    with a vocabulary-sized dimension is the log-softmax's kind of work. The shares add
    up to the step's profiled self time."""
    out = dict.fromkeys(FAMILIES, 0.0)
    for name, shapes, us in events:
        dims = {d for shape in shapes for d in shape}
        wide = vocab is not None and vocab in dims
        if "scaled_dot_product" in name or "flash_attention" in name or (name in GROUPED and not wide):
            family = "attention"
        elif name in PRODUCTS:
            family = "head products" if wide else "LoRA products" if rank in dims else "other products"
        elif wide:
            family = "vocabulary-wide elementwise"
        elif name in COPIES:
            family = "casts and copies"
        else:
            family = "other"
        out[family] += us / 1e6
    return out


def top_ops(events: list[tuple[str, list[list[int]], float]], n: int = 15) -> dict[str, float]:
    """The ``n`` operators with the most self time (seconds, most first), each summed over its input
    shapes: a family's total says what kind of work a step does, this says which calls do it."""
    by_name: dict[str, float] = {}
    for name, _, us in events:
        by_name[name] = by_name.get(name, 0.0) + us / 1e6
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:n])


def profile_table(profile: dict[str, Any]) -> str:
    from .record import markdown_table

    total = sum(profile["self_seconds"].values()) or 1.0

    def rows(seconds: dict[str, float]) -> list[list[str]]:
        return [[k, f"{v:.3f}", f"{v / total:.0%}"] for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]

    ops = profile.get("ops") or {}
    by_op = markdown_table([f"operator (the {len(ops)} with the most self time)", "self seconds", "share"], rows(ops))
    return (markdown_table(["family (ours, one steady step)", "self seconds", "share"], rows(profile["self_seconds"]))
            + (f"\n\n{by_op}" if ops else "")
            + f"\n\nThe profiled step took {profile['step_seconds']:.2f} s (the profiler's own cost included); "
            "self seconds are summed over every thread (micro-batches side by side on a CPU: more than the step).")


def _step_flops(trainer: Any, lengths: list[tuple[int, int]], rank: int) -> float | None:
    """The step's model FLOPs (bench.train_gpu's count), for Llama-shaped configs; else None."""
    from .train_gpu import step_flops

    try:
        return step_flops(trainer.base.config, lengths, rank)
    except AttributeError:
        return None


def matmul_gflops(device: str, threads: int, n: int = 1024, repeat: int = 20, dtype: str = "fp32",
                  budget: float = 1.0) -> float:
    """This machine's matrix-product rate (GFLOP/s) in ``dtype``: the ceiling a training step works under.

    At most ``repeat`` products, fewer where they would take over ``budget`` seconds: on a CPU without
    native bf16 (oneDNN emulates it) one bf16 product of 1024² takes seconds, and twenty would keep the
    benchmark waiting a minute for the figure that says so."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=device, dtype=kind)
    b = torch.randn(n, n, device=device, dtype=kind)

    def timed(k: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    first = timed(1)  # warm-up, and how long one product takes
    if first >= budget:  # a product this slow is its own measurement: its warm-up is lost in it
        return 2 * n**3 / first / 1e9
    if first * 3 < budget:
        timed(2)
    k = max(1, min(repeat, int(budget / max(first, 1e-9))))
    return 2 * n**3 * k / timed(k) / 1e9


# -- the interleaved rounds ------------------------------------------------------------------------


def _forward(args: argparse.Namespace) -> list[str]:
    keep = ("model", "device", "dtype", "precision", "samples", "prompt_chars", "response_chars", "steps",
            "micro_batch_tokens", "max_tokens", "rank", "threads", "allocator")
    out: list[str] = []
    for k in keep:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def run_rounds(args: argparse.Namespace, methods: list[str]) -> list[dict]:
    from rich.progress import Progress as Bar

    results: list[dict] = []
    total = args.rounds * len(methods)
    with Bar(transient=True) as bar:
        task = bar.add_task("train_step", total=total)
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[: r % len(methods)]  # interleaved, rotated
            for m in order:
                bar.update(task, description=f"round {r + 1}/{args.rounds} · {m}")
                results.append(_child_run(args, m))
                bar.advance(task)
    return results


def _child_run(args: argparse.Namespace, method: str, *extra: str) -> dict:
    """One run of ``method`` in a fresh process: its JSON figures."""
    cmd = [sys.executable, "-m", "bench.train_step", "--child", method, *_forward(args), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{method} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _profiled_run(args: argparse.Namespace) -> dict:
    """The extra ``ours`` run of ``--profile`` (not among the timed rounds: the profiler slows it)."""
    print("profiling one step of ours ...", file=sys.stderr)
    return _child_run(args, "ours", "--profile")


def summarise(results: list[dict], methods: list[str]) -> list[dict]:
    rows = []
    for m in methods:
        mine = [r for r in results if r["method"] == m]
        rows.append({
            "method": m,
            "runs": len(mine),
            "tokens_per_step": mine[0]["tokens_per_step"],
            "precision": mine[0].get("precision", "fp32"),
            "attention": mine[0].get("attention"),
            "allocator": mine[0].get("allocator", "system"),
            "step_tokens_per_s": statistics.median(r["step_tokens_per_s"] for r in mine),
            "run_tokens_per_s": statistics.median(r["run_tokens_per_s"] for r in mine),
            "model_gflops_per_s": statistics.median(r["step_model_gflops_per_s"] or 0.0 for r in mine),
            "peak_bytes": statistics.median(r["peak_bytes"] for r in mine),
            "above_base_bytes": statistics.median(r["above_base_bytes"] for r in mine),
            "base_bytes": mine[0]["base_bytes"],
        })
    kto = next((r for r in rows if r["method"] == "kto"), None)
    variants = [r for r in rows if r["method"] in VARIANTS]
    for r in rows:
        for v in variants:
            r[_speed_key(v["method"])] = r["step_tokens_per_s"] / v["step_tokens_per_s"]
        if kto:
            r["speed_vs_kto"] = r["step_tokens_per_s"] / kto["step_tokens_per_s"]
            r["peak_vs_kto"] = r["peak_bytes"] / kto["peak_bytes"]
            r["above_base_vs_kto"] = r["above_base_bytes"] / max(kto["above_base_bytes"], 1)
    return rows


def _speed_key(method: str) -> str:
    """``ours-fp32`` -> ``speed_vs_ours_fp32``: the JSON key of a row's speed against that variant."""
    return "speed_vs_" + method.replace("-", "_")


def table(rows: list[dict]) -> str:
    from .record import markdown_table

    def mib(b: float) -> str:
        return f"{b / 2**20:,.0f} MiB"

    def times(r: dict, key: str) -> str:
        return f"{r[key]:.2f}×" if key in r else "–"

    # "speed vs ours fp32" always (the precision's gain), the other variants where a run has them
    shown = ["ours-fp32"] + [m for m in VARIANTS if m != "ours-fp32" and any(r["method"] == m for r in rows)]
    header = ["method", "precision", "malloc", "tokens/step", "step tokens/s", "run tokens/s", "model GFLOP/s",
              "peak memory", "above base", "speed vs KTO", *(f"speed vs {VARIANTS[m]}" for m in shown), "peak vs KTO",
              "above-base vs KTO"]
    body = [
        [r["method"], r["precision"], r["allocator"], r["tokens_per_step"],
         f"{r['step_tokens_per_s']:,.0f}", f"{r['run_tokens_per_s']:,.0f}",
         f"{r['model_gflops_per_s']:,.1f}",
         mib(r["peak_bytes"]), mib(r["above_base_bytes"]),
         times(r, "speed_vs_kto"), *(times(r, _speed_key(m)) for m in shown),
         f"{r['peak_vs_kto']:.2f}×" if "peak_vs_kto" in r else "–",
         f"{r['above_base_vs_kto']:.2f}×" if "above_base_vs_kto" in r else "–"]
        for r in rows
    ]
    return markdown_table(header, body)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("bench.train_step", __doc__)
    ap.add_argument("--model", default="default", help="default | tiny | arch:NAME | a folder")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="base weights (default fp32)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="ours' and two-copy's forward passes, as train.precision (default auto: bf16 where "
                         "the GPU or CPU does it natively); ours-fp32 is always fp32")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma list of {', '.join(METHODS)} (default {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--samples", type=int, default=32, help="rated samples per step (default 32)")
    ap.add_argument("--prompt-chars", type=int, default=200, help="prompt length in characters (default 200)")
    ap.add_argument("--response-chars", type=int, default=400, help="answer length in characters (default 400)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4; the first is not timed)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048, help="micro-batch budget (default 2048)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="per-sample token cap (default 1024)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per run (default: torch's choice)")
    ap.add_argument("--allocator", choices=["auto", "system"], default="auto",
                    help="every run's malloc, as train.allocator (default auto: mimalloc or jemalloc where the "
                         "training worker would preload one); ours-glibc is always the system's")
    output_options(ap)
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one steady step of `ours` (an extra run) and print where its time goes")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.child:
        from rlfleet.shared.allocator import preload

        # (an exec where it preloads one: this child starts again with the same arguments)
        preload("system" if args.child == "ours-glibc" else args.allocator)
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON line only
            result = child(args)
        print(json.dumps(result))
        return result
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    rows = summarise(run_rounds(args, methods), methods)
    profile = _profiled_run(args)["profile"] if args.profile else None
    from rlfleet.shared.models import pick_device

    device = pick_device(args.device)
    ceiling = matmul_gflops(device, args.threads)
    ceiling_bf16 = matmul_gflops(device, args.threads, dtype="bf16")
    summary = {"model": args.model, "device": args.device, "dtype": args.dtype, "precision": args.precision,
               "rounds": args.rounds, "rows": rows, "matmul_gflops_per_s": ceiling,
               "matmul_bf16_gflops_per_s": ceiling_bf16, **({"profile": profile} if profile else {})}
    text = table(rows) + (
        f"\n\nMatrix products on this machine (1024², same threads): fp32 {ceiling:,.1f} GFLOP/s, bf16 "
        f"{ceiling_bf16:,.1f} GFLOP/s. Model GFLOP/s "
        "counts the step's needed work as bench.train_gpu does (frozen linears 4·N, LoRA 6 per parameter, "
        "causal attention, the head on answer tokens)."
    ) + (f"\n\n{profile_table(profile)}" if profile else "")
    title = (f"`bench.train_step` · {args.model} · weights {args.dtype} · precision {args.precision}"
             f" · allocator {args.allocator}")
    publish(summary, text, args, title)
    return summary


if __name__ == "__main__":
    main()
