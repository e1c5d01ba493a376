"""Measure a model (the base, or the base plus an adapter) on held-out rated answers for the gate.

Teacher-forced over the held-out answers: the mean log-prob of each, the exact KL to the base and
the next-token entropy at each answer position. Sampled on a few held-out prompts: distinct
bigrams and length, the collapse signals a teacher-forced pass cannot see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch

from rlfleet.shared.responder import seeded_rng

from .batching import encode_sample
from .gate import GateConfig, ModelScores
from .samples import TrainSample
from .trainer import Trainer


@torch.no_grad()
def score_model(
    trainer: Trainer,
    pairs: Sequence[tuple[list[dict], str]],
    adapter_dir: Path | None,
    cfg: GateConfig,
    max_tokens: int = 1024,
    seed: int = 0,
) -> ModelScores:
    if hasattr(trainer, "score_model"):  # a trainer of another framework (MLX) measures itself
        return trainer.score_model(pairs, adapter_dir, cfg, max_tokens, seed)
    samples = [TrainSample(i, p, r, 0.0) for i, (p, r) in enumerate(pairs)]
    encoded = [encode_sample(trainer.tokenizer, s, max_tokens) for s in samples]
    groups, batches = trainer._batches(encoded, 4096)
    n = len(encoded)
    lp_sum, ent_sum, kl_sum, count = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    with contextlib.ExitStack() as stack:
        model = trainer.base
        if adapter_dir is not None:
            model = stack.enter_context(trainer._adapter(Path(adapter_dir), None, trainable=False))
        for g, batch in zip(groups, batches, strict=True):
            logp, rows, targets = _response_logprobs(model, batch)
            if adapter_dir is not None:
                with model.disable_adapter():
                    ref, _, _ = _response_logprobs(model, batch)
                kl = (logp.exp() * (logp - ref)).sum(-1)
            else:
                kl = torch.zeros(logp.shape[0])
            ent = -(logp.exp() * logp).sum(-1)
            tok = logp.gather(-1, targets[:, None]).squeeze(-1)
            for k, row in enumerate(rows.tolist()):
                i = g[row]
                lp_sum[i] += float(tok[k])
                ent_sum[i] += float(ent[k])
                kl_sum[i] += float(kl[k])
                count[i] += 1
        sampled = [
            _sample(trainer, model, p, cfg.eval_new_tokens, seed + j)
            for j, (p, _r) in enumerate(pairs[: cfg.eval_prompts])
        ]
    return ModelScores.from_sums(lp_sum, ent_sum, kl_sum, count, sampled)


def _response_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax rows ``[N, V]`` for every predicted answer token, the batch row of each, targets."""
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    pred = resp[:, 1:]
    rows = pred.nonzero()[:, 0]
    return torch.log_softmax(logits[pred].float(), dim=-1), rows.cpu(), ids[:, 1:][pred]


def _sample(trainer: Trainer, model, prompt: list[dict], max_new_tokens: int, seed: int) -> list[int]:
    tok = trainer.tokenizer
    enc = tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    ids = enc["input_ids"].to(trainer.device)
    eos = tok.eos_token_id
    with seeded_rng(seed, trainer.device):
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=True, temperature=0.7, top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id or eos,
        )
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(eos)] if eos in new else new
