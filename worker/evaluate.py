"""Measure a model (the base, or the base plus an adapter) on held-out rated answers for the gate.

Teacher-forced over the held-out answers: the mean log-prob of each, the exact KL to the base and
the next-token entropy at each answer position. Sampled answers on the held-out prompts (one
batched ``generate``: on a CPU a batch of eight costs about what two answers one by one do): distinct
bigrams, repetition inside each answer and length, the signals a teacher-forced pass cannot see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch

from rlfleet.shared.responder import seeded_rng

from .batching import _ids, encode_sample
from .gate import GateConfig, ModelScores, sample_plan
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
        prompts = sample_plan([p for p, _r in pairs], cfg.eval_samples)
        sampled = _sample(trainer, model, prompts, cfg.eval_new_tokens, seed) if prompts else []
    return ModelScores.from_sums(lp_sum, ent_sum, kl_sum, count, sampled)


def _response_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax rows ``[N, V]`` for every predicted answer token, the batch row of each, targets."""
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    pred = resp[:, 1:]
    rows = pred.nonzero()[:, 0]
    return torch.log_softmax(logits[pred].float(), dim=-1), rows.cpu(), ids[:, 1:][pred]


def _sample(trainer: Trainer, model, prompts: list[list[dict]], max_new_tokens: int, seed: int) -> list[list[int]]:
    """One sampled answer per prompt (temperature 0.7), as token ids up to the end token."""
    tok = trainer.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    rows = [_ids(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)) for p in prompts]
    width = max(len(r) for r in rows)
    # Left padding: every row's next token is generated at the same position.
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=trainer.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=trainer.device)
    with seeded_rng(seed, trainer.device):
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
            do_sample=True, temperature=0.7, top_p=1.0, top_k=0, pad_token_id=pad,
        )
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: row.index(eos)] if eos in row else row)
    return answers
