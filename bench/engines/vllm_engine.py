"""Run one real vLLM engine (in-process mode) in this process and print what it did, as JSON.

    python -m bench.engines.vllm_engine < SPEC_JSON

SPEC: ``model`` (path), ``runs`` (a list of ``{"prompts": [[token ids]...], "max_tokens": n}``,
each one ``LLM.generate`` call, timed; ``"connector_attrs": {name: value}`` sets attributes of
the worker's connector first, e.g. ``merge_calls``; ``"scheduler_attrs"`` those of the scheduler's,
e.g. ``saves``, for that run and the next ones), and optionally ``connector`` (the
``kv_connector_extra_config`` of ``clients.vllm_connector.KVCacheConnector``; ``kv_role``, default
``kv_both``), ``prefix_caching``
(default true), ``max_model_len`` (default 1024). Prints one line: ``{"runs": [{"outputs":
[{"tokens", "cached"}], "seconds", "stats"}]}``, where ``stats`` is the connector's cumulative
``ConnectorStats`` after the run. The tests and ``kvcache bench vllm`` start one process per
engine, so that no engine sees another's KV memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process
    from vllm import LLM, SamplingParams

    max_len = spec.get("max_model_len", 1024)
    kw: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_len,
        block_size=32,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        enable_prefix_caching=spec.get("prefix_caching", True),
    )
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "clients.vllm_connector",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    if spec.get("kv_events") is not None:  # {"endpoint": ..., "replay_endpoint": ...}
        kw["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "",
            **spec["kv_events"],
        }
    llm = LLM(**kw)
    from clients.vllm_connector import STATS

    out = []
    for r in spec["runs"]:
        if r.get("connector_attrs") and spec.get("connector") is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()  # in this process: no engine-core processes
            for name, value in r["connector_attrs"].items():
                setattr(worker, name, value)
        if r.get("scheduler_attrs") and spec.get("connector") is not None:
            # the scheduler's connector (in this process): e.g. ``saves`` and ``loads`` off for
            # a run that measures the same engine with its connector idle
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
            for name, value in r["scheduler_attrs"].items():
                setattr(scheduler, name, value)
        params = SamplingParams(max_tokens=r.get("max_tokens", 8), temperature=0)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in r["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        outputs = [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
            for o in res
        ]
        out.append({"outputs": outputs, "seconds": seconds, "stats": asdict(STATS)})
    time.sleep(spec.get("linger_s", 0))  # e.g. while a subscriber reads the events
    return {"runs": out}


def main() -> None:
    # NOTE: the spec comes on stdin: prompts of thousands of tokens overflow an argument.
    print(json.dumps(run(json.load(sys.stdin))), flush=True)


if __name__ == "__main__":
    main()
