"""The conductor fed by vLLM's KV events: keys derived from vLLM's blocks equal every client's,
and a real engine's cache shows up in the conductor's index."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from clients.conductor_client import ConductorClient
from conductor.vllm_events import KeyChain
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout

from helpers import wait_until

LAYOUT = KVLayout(
    model="tiny-llama", num_layers=2, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=64
)
LAYOUT_FLAG = "model=tiny-llama,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=64"
PROMPT = [int(x) for x in np.random.default_rng(5).integers(1, 500, 299)]


def test_keys_from_vllm_blocks_are_the_common_chain():
    chain = KeyChain(LAYOUT)
    toks = PROMPT[:288]  # nine 32-token vLLM blocks
    got = chain.stored(["h0", "h1"], None, toks[:64])  # one event, two blocks
    got += chain.stored(["h2"], "h1", toks[64:96])
    got += chain.stored(["h3", "h4", "h5"], "h2", toks[96:192])
    got += chain.stored(["h6", "h7", "h8"], "h5", toks[192:288])
    assert got == block_keys(toks, 64, root_key(LAYOUT.namespace))[:4]
    assert chain.stored(["x"], "unknown-parent", toks[:32]) == []
    # A removed vLLM block takes the block of ours it is part of, and only that one.
    assert chain.removed(["h3"]) == [got[1]]
    assert sorted(chain.cleared()) == sorted([got[0], got[2], got[3]])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_real_engines_cache_is_routed_by_the_conductor(tmp_path, start_kvcache):
    pytest.importorskip("vllm")
    from bench.engines.models import MODELS, make_model

    model = str(tmp_path / "tiny-llama")
    make_model(model, MODELS["tiny"], max_len=1024)
    pub, replay = _port(), _port()
    conductor = start_kvcache(
        "conductor",
        "--listen",
        "127.0.0.1:0",
        "--vllm-layout",
        LAYOUT_FLAG,
        "--vllm-events",
        f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}=engine-0",
    )
    spec = {
        "model": model,
        "runs": [{"prompts": [PROMPT], "max_tokens": 4}],
        "linger_s": 3,
        "kv_events": {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"},
    }
    engine = subprocess.Popen(
        [sys.executable, "-m", "bench.engines.vllm_engine"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = engine.communicate(json.dumps(spec), timeout=240)
    assert engine.returncode == 0, err[-3000:]
    with ConductorClient(conductor.address) as cc:
        assert "engine-0" in {n.node.node_id for n in cc.list_nodes().nodes}
        # The engine cached the prompt's 4 full blocks of 64 tokens (and what it generated).
        wait_until(
            lambda: cc.locate(LAYOUT.namespace, tokens=PROMPT).get("engine-0") == 4,
            timeout_s=20,
            what="the engine's blocks in the conductor's index",
        )
        reply = cc.schedule(LAYOUT.namespace, tokens=PROMPT, prompt_tokens=len(PROMPT))
        assert reply.prefill_node == "engine-0" and reply.local_blocks == 4


@pytest.mark.slow
def test_a_gap_in_the_event_sequence_is_filled_from_the_replay_socket(start_kvcache):
    """vLLM's own publisher; the first batch goes out before the conductor subscribes, so the
    conductor sees the sequence start at 1 and must replay 0 to know the chain's start."""
    pytest.importorskip("vllm")
    import time

    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    pub, replay = _port(), _port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}")
    toks = PROMPT[:192]

    def stored(hashes, parent, lo, hi):
        return KVEventBatch(
            ts=time.time(),
            events=[
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=toks[lo:hi],
                    block_size=32,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                )
            ],
        )

    try:
        publisher.publish(stored([b"h0", b"h1"], None, 0, 64))  # seq 0: nobody listens
        time.sleep(0.5)
        conductor = start_kvcache(
            "conductor",
            "--listen",
            "127.0.0.1:0",
            "--vllm-layout",
            LAYOUT_FLAG,
            "--vllm-events",
            f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}=engine-0",
        )
        with ConductorClient(conductor.address) as cc:
            keys = block_keys(toks, 64, root_key(LAYOUT.namespace))
            seq = 1
            # Publish until the subscription is up (ZMQ drops what a late subscriber missed).
            deadline = time.monotonic() + 20
            while cc.locate(LAYOUT.namespace, keys=keys).get("engine-0", 0) < 2:
                assert time.monotonic() < deadline, "the engine's blocks never reached the index"
                publisher.publish(stored([b"h2", b"h3"], b"h1", 64, 128))  # needs h1 (seq 0)
                seq += 1
                time.sleep(0.3)
            publisher.publish(stored([b"h4", b"h5"], b"h3", 128, 192))
            wait_until(
                lambda: cc.locate(LAYOUT.namespace, keys=keys).get("engine-0") == 3,
                timeout_s=10,
                what="the third block",
            )
    finally:
        publisher.shutdown()
