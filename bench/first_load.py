"""A GGUF model's first load: rlfleet's (metadata parsed once, the copy written) against transformers alone.

The first time a process on a machine loads a GGUF model (the default one included) it dequantises
the file; later loads read the copy that load wrote (shared/gguf_copy.py). This times, in one process
and one after another:

- transformers alone: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` and
  ``AutoTokenizer.from_pretrained`` the same way, as a user of transformers would load the file;
- rlfleet's first load: ``load_tokenizer`` and ``load_model`` on an empty model cache (the file's
  metadata parsed once per load, :func:`rlfleet.shared.models.gguf_parsed_once`, and the copy written);
- rlfleet's later load: the same two calls again, reading the copy;

and checks that rlfleet's first load gives the very weights transformers alone does.

    python -m bench.first_load [--model smollm2-135m] [--threads N] [--json] [--no-record]
"""

from __future__ import annotations

import os
import tempfile
import time

from .record import markdown_table, output_options, parser, publish


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.first_load", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF model: alias or folder (default: the default one)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    output_options(ap)
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlfleet.shared.models import load_model, load_tokenizer, resolve_model

    ref = resolve_model(args.model)
    if not ref.gguf_file:
        ap.error(f"{args.model} is not a GGUF model: it has no copy to make")
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-first-load-") as cache:
        os.environ["RLFLEET_MODEL_CACHE"] = cache
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t = time.perf_counter()
        AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)
        theirs = AutoModelForCausalLM.from_pretrained(ref.path, gguf_file=ref.gguf_file, dtype=torch.float32)
        alone = time.perf_counter() - t
        t = time.perf_counter()
        load_tokenizer(ref)
        mine = load_model(ref)
        first = time.perf_counter() - t
        a, b = theirs.state_dict(), mine.state_dict()
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        del theirs, mine, a, b
        t = time.perf_counter()
        load_tokenizer(ref)
        load_model(ref)
        later = time.perf_counter() - t
    figures = {"model": ref.spec, "threads": torch.get_num_threads(), "transformers_s": alone,
               "rlfleet_first_s": first, "rlfleet_later_s": later, "first_vs_transformers": first / alone,
               "same_weights": same}
    table = markdown_table(
        ["load", "seconds", "vs transformers alone"],
        [["transformers alone (tokenizer + model)", f"{alone:.1f}", "1.00×"],
         ["rlfleet, first (tokenizer + model + the copy written)", f"{first:.1f}", f"{first / alone:.2f}×"],
         ["rlfleet, later (from the copy)", f"{later:.1f}", f"{later / alone:.2f}×"]]
    ) + f"\n\nThe same weights as transformers alone: {'yes' if same else 'NO'}."
    publish(figures, table, args, f"`bench.first_load` · {ref.spec} · {figures['threads']} threads")
    return figures


if __name__ == "__main__":
    main()
