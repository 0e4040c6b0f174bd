"""Run one real vLLM engine (CPU, in-process mode) in this process and print what it generated.

    python tests/vllm_engine.py SPEC_JSON   ->  one JSON line {"outputs": [{"tokens", "cached"}]}

SPEC: model (path), prompts (lists of token ids), max_tokens, and optionally connector (the
``kv_connector_extra_config`` of clients.vllm_connector.KVCacheConnector). Each engine runs in a
process of its own so that no engine can see another's KV memory.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kw = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        block_size=32,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=spec.get("max_model_len", 1024),
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=True,
    )
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "clients.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    print(
        json.dumps(
            {
                "outputs": [
                    {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
                    for o in outs
                ]
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
