"""Where a decoded token's time goes: the model's one-token forward against its linear layers' matrix-vector
products alone, in fp32 and bf16.

At batch 1 every linear layer multiplies one row by its weight matrix, so a token reads every weight
once. When the products alone take most of the forward, the forward is bound by reading the weights
(bytes per token), not by per-operation overhead, and fewer bytes per weight (a quantised format, as
llama.cpp's) is what makes it faster. The products are timed on the model's own weight shapes with a
random row, each repeated ``--repeat`` times after a warm-up; the forward is the loaded model decoding
one token on an 8-token cache, the way the responder does.

    python -m bench.decode_cost [--model smollm2-135m] [--threads N] [--repeat 10] [--json] [--no-record]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .record import markdown_table, output_options, parser, publish


def _ms(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call of ``fn``, after three warm-up calls."""
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1000


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.decode_cost", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls of each measurement (default 10)")
    output_options(ap)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    import torch
    from transformers import DynamicCache

    from rlfleet.shared.models import cache_argument, load_model, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def products(dtype: torch.dtype) -> float:
        pairs = [(m.weight.detach().to(dtype), torch.randn(1, m.in_features, dtype=dtype)) for m in linears]
        return _ms(lambda: [torch.nn.functional.linear(x, w) for w, x in pairs], args.repeat)

    arg = cache_argument(model)

    def one_token() -> float:
        """Milliseconds to decode one token after an 8-token prompt (the prompt's pass not counted)."""
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.arange(1, 9)[None], use_cache=True, **{arg: cache})
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([[9]]), use_cache=True, logits_to_keep=1, **{arg: cache})
        return (time.perf_counter() - t0) * 1000

    with torch.no_grad():
        timed = [one_token() for _ in range(args.repeat + 3)][3:]  # three warm-up tokens
        forward_ms = statistics.median(timed)
        fp32_ms, bf16_ms = products(torch.float32), products(torch.bfloat16)

    figures = {"model": args.model, "linears": len(linears), "weight_mb_fp32": weight_bytes / 1e6,
               "forward_ms": forward_ms, "linears_fp32_ms": fp32_ms, "linears_bf16_ms": bf16_ms,
               "linears_share": fp32_ms / forward_ms, "threads": torch.get_num_threads()}
    text = markdown_table(
        ["one decoded token (fp32 forward, median)", "its linears' products alone, fp32", "share",
         "the same products in bf16", "weights read per token (fp32)"],
        [[f"{forward_ms:.1f} ms", f"{fp32_ms:.1f} ms ({len(linears)} layers)", f"{fp32_ms / forward_ms:.0%}",
          f"{bf16_ms:.1f} ms", f"{weight_bytes / 1e6:.0f} MB"]])
    publish(figures, text, args, f"`bench.decode_cost` · {args.model} · threads {torch.get_num_threads()}")
    return figures


if __name__ == "__main__":
    main()
