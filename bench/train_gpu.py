"""Our training step on a CUDA GPU at 8B scale: tokens/s and model FLOPs utilisation (MFU).

A random-init Llama-3.1-8B-shaped model (bf16 weights, SDPA attention; the weights do not change
the work) gets a fresh LoRA on all linear layers and runs the worker's own Trainer.run over rated
samples of realistic length (default: 1,024-token prompts, 512-token answers, 16 ratings a step), in
the precision a user's config resolves to (``train.precision = "auto"``: bf16 autocast on a GPU).

Model FLOPs per trained token, counted as the work the step needs (not what a kernel happens to do):
  * linear layers, frozen: forward 2·N, backward 2·N (input gradients only; frozen weights get none)
  * LoRA adapters, trained: 6 FLOPs per adapter parameter
  * attention scores and mixing, causal: forward 2·L·d per layer, backward twice that
  * output head: on answer tokens only (the loss needs nothing else): forward and backward 4·d·V
MFU = those FLOPs per second over the card's dense bf16 peak. The once-per-run reference pass is
not a step: it is reported beside, in the whole-run tokens/s.

    python -m bench.train_gpu                                   # on a CUDA machine
    python -m bench.train_gpu --arch tiny --device cpu --steps 3   # a smoke run anywhere
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from .record import output_options, parser, publish

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "RTX 4090": 165.2,
    "A10G": 70.0,
}


def peak_tflops(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # the most specific name first
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def linear_params(cfg: Any) -> int:
    """Weights of the per-layer linear maps (attention projections and MLP), all layers."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * i
    return per_layer * cfg.num_hidden_layers


def lora_params(cfg: Any, rank: int) -> int:
    d, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, i), (d, i), (i, d)]
    return rank * sum(a + b for a, b in shapes) * cfg.num_hidden_layers


def step_flops(cfg: Any, lengths: list[tuple[int, int]], rank: int) -> float:
    """Model FLOPs of one optimizer step over samples of ``(prompt_len, response_len)``."""
    n_lin, n_lora = linear_params(cfg), lora_params(cfg, rank)
    d, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    total = 0.0
    for prompt, response in lengths:
        seq = prompt + response
        total += seq * (4 * n_lin + 6 * n_lora)
        total += layers * 3 * 2 * d * seq * seq / 2  # causal: each token attends to half, on average
        total += response * 4 * d * vocab
    return total


# Kernel names by family, first match wins (CUDA kernel names of cuBLAS/cuDNN/ATen on sm80/sm90).
KERNEL_FAMILIES = (
    ("matmul fp32", ("f32f32", "sgemm")),
    ("matmul bf16/fp16", ("nvjet", "gemm", "xmma", "cutlass")),
    ("attention", ("sdpa", "flash", "fmha")),
    ("elementwise (casts, pointwise)", ("elementwise", "CatArray", "copy")),
    ("reductions (softmax, norms, sums)", ("reduce", "softmax", "norm")),
)


def kernel_family(name: str) -> str:
    for family, keys in KERNEL_FAMILIES:
        if any(k.lower() in name.lower() for k in keys):
            return family
    return "other"


def family_shares(times: dict[str, float]) -> dict[str, float]:
    """Each family's share of the summed device time, from ``{kernel name: self device time}``."""
    total = sum(times.values()) or 1.0
    shares: dict[str, float] = {}
    for name, t in times.items():
        fam = kernel_family(name)
        shares[fam] = shares.get(fam, 0.0) + t / total
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}


def table_times(text: str) -> dict[str, float]:
    """``{kernel name: self device time in µs}`` read back from a printed ``--profile`` table (its
    Self CUDA column, the fifth from the right), so a saved profile can be summed by family again."""
    import re

    times: dict[str, float] = {}
    for line in text.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 10 or not cols[-1].isdigit():
            continue
        m = re.fullmatch(r"([0-9.]+)(s|ms|us)", cols[-5])
        if m:
            key = cols[0] if cols[0] not in times else f"{cols[0]} #{len(times)}"  # names cut short repeat
            times[key] = float(m[1]) * _UNITS[m[2]]
    return times


@contextlib.contextmanager
def _profiled(on: bool, cuda: bool) -> Iterator[Any]:
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        yield prof


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.train_gpu", __doc__)
    ap.add_argument("--arch", default="llama-8b", help="llama-8b | smollm2-135m | tiny (default llama-8b)")
    ap.add_argument("--device", default="cuda", help="default cuda")
    ap.add_argument("--samples", type=int, default=16, help="rated samples per step (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="default 1024")
    ap.add_argument("--response-tokens", type=int, default=512, help="default 512")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="default 4096")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps; the first is not timed (default 5)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from the name)")
    ap.add_argument("--unlikelihood", type=float, default=None,
                    help="train.unlikelihood (default: the preset's; 0 leaves out its sampled loop checks)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="train.precision of the run (default auto, as a user's config: bf16 autocast on a GPU)")
    ap.add_argument("--profile", action="store_true",
                    help="print where the GPU's time goes (torch.profiler, top kernels by CUDA time)")
    ap.add_argument("--families", type=Path, metavar="FILE",
                    help="sum a saved --profile table by kernel family and stop (nothing runs)")
    output_options(ap)
    args = ap.parse_args(argv)
    if args.families is not None:
        if not args.families.is_file():
            ap.error(f"no such file: {args.families}")
        shares = family_shares(table_times(args.families.read_text(errors="replace")))
        if not shares:
            ap.error(f"{args.families} holds no profile table")
        for fam, share in shares.items():
            print(f"  {share:6.1%}  {fam}")
        return {"families": shares}
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")

    import torch

    from rlfleet.shared.chat_prompt import prompt_ids
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.presets import preset
    from rlfleet.worker.samples import Progress
    from rlfleet.worker.training.torch_backend import Trainer

    from . import synthetic
    from .record import markdown_table

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; for a smoke run use --arch tiny --device cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tok = synthetic.byte_tokenizer()
    t0 = time.perf_counter()
    model = synthetic.random_model(args.arch, tok, args.device, dtype)
    trainer = Trainer.from_model(model, tok, args.device)
    built = time.perf_counter() - t0

    # The chat template adds a few tokens around the prompt; trim the text so lengths come out exact.
    overhead = len(prompt_ids(tok, [{"role": "user", "content": ""}]))
    samples = synthetic.ratings(args.samples, max(args.prompt_tokens - overhead, 1), args.response_tokens - 1)
    cfg = replace(
        preset("balanced"), steps=args.steps, micro_batch_tokens=args.micro_batch_tokens,
        max_tokens=args.prompt_tokens + args.response_tokens + 8, rank=args.rank, alpha=args.rank,
        precision=args.precision,  # a bare preset says fp32; a user's config resolves to auto
    )
    if args.unlikelihood is not None:
        cfg = replace(cfg, unlikelihood=args.unlikelihood)
    encoded = [encode_sample(tok, s, cfg.max_tokens) for s in samples]
    lengths = [(e.prompt_len, e.n_response) for e in encoded]
    tokens = sum(p + r for p, r in lengths)
    flops = step_flops(model.config, lengths, args.rank)

    stamps: dict[int, float] = {}

    def on_progress(p: Progress) -> None:
        if p.phase == "training" and p.step >= 1:
            if cuda:
                torch.cuda.synchronize()
            stamps.setdefault(p.step, time.perf_counter())
            print(f"  step {p.step}/{p.total}", flush=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlfleet-gpu-") as out, _profiled(args.profile, cuda) as prof:
        result = trainer.run(samples, None, cfg, None, Path(out) / "a", progress=on_progress)
    run_seconds = time.perf_counter() - started
    if prof is not None:
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        events = prof.key_averages()
        print(events.table(sort_by=sort, row_limit=30), file=sys.stderr)
        if cuda:  # device kernels only (the CPU-side aten ops would count their kernels twice)
            times = {e.key: e.self_device_time_total for e in events if e.self_device_time_total > 0}
            print("device time by kernel family (the whole run: reference passes and every step):",
                  file=sys.stderr)
            for fam, share in family_shares(times).items():
                print(f"  {share:6.1%}  {fam}", file=sys.stderr)
    times = [stamps[s] for s in sorted(stamps)]
    step_seconds = (times[-1] - times[0]) / (len(times) - 1)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if cuda else None)
    achieved = flops / step_seconds / 1e12
    figures = {
        "arch": args.arch,
        "device": name,
        "params": trainer.n_params,
        "lora_params": lora_params(model.config, args.rank),
        "samples": args.samples,
        "tokens_per_step": tokens,
        "micro_batch_tokens": args.micro_batch_tokens,
        "step_seconds": step_seconds,
        "tokens_per_s": tokens / step_seconds,
        "run_tokens_per_s": tokens * args.steps / run_seconds,
        "model_tflops_per_s": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "build_seconds": built,
        "accepted_seq_frac": result.metrics["accepted_seq_frac"],
        "unlikelihood": cfg.unlikelihood,
        "precision": result.metrics["precision"],
    }
    rows = [[
        f"{args.arch} ({trainer.n_params / 1e9:.2f} B)", figures["precision"],
        f"{args.samples} × ({args.prompt_tokens}+{args.response_tokens})",
        f"{tokens:,}", f"{step_seconds:.2f} s", f"{figures['tokens_per_s']:,.0f}",
        f"{figures['run_tokens_per_s']:,.0f}",
        f"{achieved:,.0f}", f"{figures['mfu']:.1%}" if figures["mfu"] is not None else "n/a",
        f"{figures['peak_memory_gib']:.1f} GiB" if cuda else "n/a",
    ]]
    text = markdown_table(
        ["model", "precision", "ratings × (prompt+answer)", "tokens/step", "step", "tokens/s", "run tokens/s",
         "model TFLOP/s", "MFU", "peak memory"], rows)
    publish(figures, text, args, f"`bench.train_gpu` · {args.arch} · LoRA r{args.rank}"
            + (f" · unlikelihood {cfg.unlikelihood:g}" if args.unlikelihood is not None else ""))
    return figures


if __name__ == "__main__":
    main()
