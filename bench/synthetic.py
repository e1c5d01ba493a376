"""Offline models and ratings for the systems benchmarks: nothing is downloaded.

Throughput and memory depend on a model's shapes, not on its weights, so a random-init model of a
named architecture stands in for the real one where its weights are not at hand (on a GPU machine,
say, or for an 8B model). Text goes through a byte-level tokenizer: one character is one token, so
prompt and response lengths in tokens are exactly what was asked for.
"""

from __future__ import annotations

import random
from typing import Any

from rlfleet.worker.samples import TrainSample

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

# Shapes of real models (their config.json), for random-init stand-ins. ``vocab_size`` None: the byte
# tokenizer's own size (the tests' tiny model).
ARCHS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=None, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's architecture.
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    # meta-llama/Llama-3.1-8B: the 8B class.
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def byte_tokenizer() -> Any:
    """A byte-level tokenizer with a ChatML template: every byte is one token, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def llama_config(arch: str, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    shape = dict(ARCHS[arch])
    shape["vocab_size"] = shape["vocab_size"] or len(tokenizer)
    return LlamaConfig(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def random_model(arch: str, tokenizer: Any, device: str = "cpu", dtype: Any = None, seed: int = 0) -> Any:
    """A random-init Llama of ``arch``, built directly on ``device`` in ``dtype`` (no fp32 detour)."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(arch, tokenizer)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _text(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < n_chars:
        w = "".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(2, 9)))
        words.append(w)
        length += len(w) + 1
    return (" ".join(words) + "e" * n_chars)[:n_chars]  # exactly n_chars: the join may end one short


def ratings(n: int, prompt_chars: int, response_chars: int, seed: int = 0) -> list[TrainSample]:
    """``n`` rated samples, half good and half bad, with prompts and answers of the given length.

    With :func:`byte_tokenizer` a character is a token (the chat template adds about a dozen more);
    with a real tokenizer the token counts are whatever it makes of the text.
    """
    rng = random.Random(seed)
    return [
        TrainSample(
            rating_id=i,
            prompt=[{"role": "user", "content": _text(rng, prompt_chars)}],
            response=_text(rng, response_chars),
            reward=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(n)
    ]
