"""Random-weight Llama models for real vLLM engines on a CPU, made locally (no downloads).

    python -m bench.engines.models tiny out/serve/tiny-llama     # model + a byte-level tokenizer

``tiny`` (2 layers, hidden 128, head_dim 32: what vLLM's CPU attention accepts,
shared/notes/vllm-cpu.md) and ``100m`` (12 layers, hidden 768). With ``tokenizer`` the directory
also holds a byte-level tokenizer (``<unk>``, ``<s>``, ``</s>`` = ids 0-2, the 256 bytes, then
made-up words up to the vocabulary size), so an engine serves text prompts and detokenizes its
output, and a chat template in its config (``CHAT_TEMPLATES``: a Llama-3-style one by default,
``--chat-template`` another), so an engine serves ``/v1/chat/completions``.
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

# Chat templates in the styles of well-known model families (their markers are plain bytes to the
# byte-level tokenizer; ``bos_token`` is its ``<s>``).
CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 2 / Mistral: the system prompt folded into the first user turn
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ bos_token }}[INST] {{ (system if loop.first else '') + m['content'] }} [/INST]"
        "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
    ),
}


def make_model(
    path: str,
    shape: dict[str, Any],
    max_len: int,
    tokenizer: bool = False,
    chat_template: str = "llama3",
) -> None:
    """A random bfloat16 Llama of ``shape`` saved at ``path`` (kept if it is there), with a
    byte-level tokenizer and ``CHAT_TEMPLATES[chat_template]`` if ``tokenizer``."""
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
        save_byte_tokenizer(path, shape["vocab_size"], CHAT_TEMPLATES[chat_template])


def make_eagle_draft(path: str, shape: dict[str, Any], max_len: int) -> None:
    """A random EAGLE draft head for a Llama of ``shape`` (vLLM's ``EagleLlamaForCausalLM``):
    one decoder layer without its input norm, ``fc`` from the token's embedding and the
    target's hidden state, no final norm; saved at ``path`` (kept if it is there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    h = shape["hidden_size"]
    cfg = LlamaConfig(
        **{**shape, "num_hidden_layers": 1},
        max_position_embeddings=max_len,
        head_dim=h // shape["num_attention_heads"],
        architectures=["LlamaForCausalLM"],
        torch_dtype="bfloat16",
    )
    weights = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    drop = {"model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"}
    head = {k.removeprefix("model."): v.contiguous() for k, v in weights.items() if k not in drop}
    head["fc.weight"] = (torch.randn(h, 2 * h) * 0.02).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(head, os.path.join(path, "model.safetensors"))
    cfg.save_pretrained(path)


def make_mtp_model(path: str, shape: dict[str, Any], max_len: int) -> None:
    """A random MiMo-style model (a Qwen2 of ``shape``, ``MiMoForCausalLM``) with one multi-token
    prediction layer (``model.mtp_layers.0``: its norms, ``input_proj`` and a decoder layer),
    for vLLM's ``method: "mtp"``; saved at ``path`` (kept if it is there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    h = shape["hidden_size"]
    extra = dict(max_position_embeddings=max_len, head_dim=h // shape["num_attention_heads"])
    cfg = Qwen2Config(**shape, **extra, tie_word_embeddings=False)
    weights = {
        k: v.contiguous() for k, v in Qwen2ForCausalLM(cfg).to(torch.bfloat16).state_dict().items()
    }
    one = Qwen2ForCausalLM(Qwen2Config(**{**shape, "num_hidden_layers": 1}, **extra))
    for k, v in one.to(torch.bfloat16).state_dict().items():
        if k.startswith("model.layers.0."):
            weights["model.mtp_layers.0." + k.removeprefix("model.layers.0.")] = v.contiguous()
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"model.mtp_layers.0.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    weights["model.mtp_layers.0.input_proj.weight"] = (torch.randn(h, 2 * h) * 0.02).to(
        torch.bfloat16
    )
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    config = cfg.to_dict()
    config.update(
        architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1, torch_dtype="bfloat16"
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def make_blip2_model(path: str, shape: dict[str, Any], max_len: int, query_tokens: int = 8) -> None:
    """A random BLIP-2 (a 56x56-pixel vision tower of 2 layers, a one-layer Q-Former, a Llama of
    ``shape`` as its language model) with a byte-level tokenizer that has ``<image>`` and BLIP-2's
    processor: a multimodal model vLLM's CPU build serves (an image becomes ``query_tokens``
    ``<image>`` tokens before the prompt); saved at ``path`` (kept if it is there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )

    os.makedirs(path, exist_ok=True)
    save_byte_tokenizer(path, shape["vocab_size"])
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    pixels = {"height": 56, "width": 56}
    Blip2Processor(
        image_processor=BlipImageProcessor(size=pixels),
        tokenizer=tok,
        num_query_tokens=query_tokens,
    ).save_pretrained(path)
    h = shape["hidden_size"]
    text = LlamaConfig(
        **{**shape, "vocab_size": len(tok)},
        max_position_embeddings=max_len,
        head_dim=h // shape["num_attention_heads"],
    )
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2)
    cfg = Blip2Config(
        vision_config=Blip2VisionConfig(
            **small, num_hidden_layers=2, image_size=56, patch_size=14
        ).to_dict(),
        qformer_config=Blip2QFormerConfig(
            **small, num_hidden_layers=1, encoder_hidden_size=64
        ).to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=query_tokens,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    Blip2ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(path)


def save_byte_tokenizer(path: str, vocab_size: int, chat_template: str | None = None) -> None:
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
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=chat_template,
    ).save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines.models", description=__doc__)
    parser.add_argument("shape", choices=sorted(MODELS))
    parser.add_argument("path")
    parser.add_argument("--max-len", type=int, default=4096, help="max position embeddings")
    parser.add_argument(
        "--chat-template",
        choices=sorted(CHAT_TEMPLATES),
        default="llama3",
        help="the tokenizer's chat template (default %(default)s)",
    )
    args = parser.parse_args(argv)
    make_model(args.path, MODELS[args.shape], args.max_len, True, args.chat_template)
    print(f"{args.shape} model with a byte-level tokenizer at {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
