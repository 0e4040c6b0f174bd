"""Factories for the torch client tests: a tiny seeded Llama, node layouts, killed-node cleanup."""

from __future__ import annotations

import torch

from kvstore.errors import StorageError
from kvstore.layout import KVLayout
from kvstore.shm import SharedSlab
from plumbing.launch import ServiceProcess

BLOCK_TOKENS = 16


def layout_spec(layout: KVLayout) -> str:
    """The ``--layout`` flag value of a node serving ``layout``."""
    return ",".join(f"{k}={v}" for k, v in layout.to_dict().items())


def start_node_for(
    start_kvcache, layout: KVLayout, dram: str = "16MiB", *extra: str
) -> ServiceProcess:
    return start_kvcache(
        "node", "--listen", "127.0.0.1:0", "--dram", dram, "--layout", layout_spec(layout), *extra
    )


def unlink_shm_of(node: ServiceProcess) -> None:
    """A SIGKILLed node cannot unlink its slabs: do it for it."""
    for name in node.info.get("shm", {}).values():
        try:
            SharedSlab.attach(name).unlink()
        except StorageError:
            pass  # already gone


def tiny_llama(seed: int = 0, layers: int = 3, kv_heads: int = 2):
    """A LlamaForCausalLM with random seeded float32 weights; no downloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
