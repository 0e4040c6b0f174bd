"""Random-weight Llama models for real vLLM engines on a CPU, made locally (no downloads).

    python -m bench.engines.models tiny out/serve/tiny-llama     # model + a byte-level tokenizer

``tiny`` (2 layers, hidden 128, head_dim 32: what vLLM's CPU attention accepts,
shared/notes/vllm-cpu.md) and ``100m`` (12 layers, hidden 768). With ``tokenizer`` the directory
also holds a byte-level tokenizer (``<unk>``, ``<s>``, ``</s>`` = ids 0-2, the 256 bytes, then
made-up words up to the vocabulary size), so an engine serves text prompts and detokenizes its
output.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # LMCache's peer model (shared/peers/lmcache/make_model.py), same shape.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
    ),
    # ~100M parameters: 12 x (4 x 768^2 attention-ish + 3 x 768 x 2048 MLP) + 32k x 768 embeddings.
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        num_hidden_layers=12,
        vocab_size=32000,
    ),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama's default bos / eos ids


def make_model(path: str, shape: dict[str, Any], max_len: int, tokenizer: bool = False) -> None:
    """A random bfloat16 Llama of ``shape`` saved at ``path`` (kept if it is there), with a
    byte-level tokenizer if ``tokenizer``."""
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            **shape,
            max_position_embeddings=max_len,
            head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        )
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    if tokenizer and not os.path.exists(os.path.join(path, "tokenizer.json")):
        save_byte_tokenizer(path, shape["vocab_size"])


def save_byte_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer without merges: every UTF-8 byte of a text is one token. Ids
    past the bytes, up to ``vocab_size``, decode to made-up words (" bako", ...): a random
    model emits them as often as bytes, and they read better than nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ("\u0120" + a + b for a in syllables for b in syllables)  # \u0120: a space, byte-level
    while len(vocab) < vocab_size:
        vocab[next(words)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines.models", description=__doc__)
    parser.add_argument("shape", choices=sorted(MODELS))
    parser.add_argument("path")
    parser.add_argument("--max-len", type=int, default=4096, help="max position embeddings")
    args = parser.parse_args(argv)
    make_model(args.path, MODELS[args.shape], args.max_len, tokenizer=True)
    print(f"{args.shape} model with a byte-level tokenizer at {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
