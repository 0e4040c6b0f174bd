"""A node server and its client under whatever protobuf / grpcio this interpreter imports.

Run by tests/test_protobuf_range.py with PYTHONPATH pointing at an overlay that holds another
protobuf (and the grpcio packages that accept it); the node it starts inherits that path. Prints
the versions it ran with, then "ok"; any failure exits non-zero with the traceback.
"""

from __future__ import annotations

import sys

import grpc
import numpy as np
from google.protobuf import __version__ as protobuf_version
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.node_client import KVStoreClient
from plumbing.launch import start_service
from rpc.status import KVCacheRpcError

LAYOUT = "model=test,num_layers=2,kv_heads=2,head_dim=32,dtype=float16,block_tokens=16"
NAMESPACE = "test|L2|H2|D32|float16|B16"
PAGE_BYTES = 8192


def main(log_dir: str) -> None:
    print(f"protobuf {protobuf_version} grpcio {grpc.__version__}", flush=True)
    node = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", LAYOUT], log_dir=log_dir
    )
    try:
        tokens = np.arange(64, dtype=np.int64)
        pages = [np.full(PAGE_BYTES, i + 1, np.uint8) for i in range(4)]
        for use_shm in (False, True):  # the streamed Put/Get and the shared-memory leases
            with grpc.insecure_channel(node.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
            client = KVStoreClient(node.address, use_shm=use_shm)
            salt = f"shm={use_shm}"
            assert client.put(NAMESPACE, pages, tokens=tokens, salt=salt).stored == 4
            assert client.lookup(NAMESPACE, tokens=tokens, salt=salt).hit_blocks == 4
            got = client.get(NAMESPACE, tokens=tokens, salt=salt)
            assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, pages))
            stats = client.stats().namespaces[0]  # map fields and uint64s
            assert stats.blocks >= 4 and sum(stats.hits.values()) >= 1, stats
            try:
                client.lookup("no|such|namespace", tokens=tokens)
            except KVCacheRpcError as e:
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            else:
                raise AssertionError("a lookup in an unknown namespace succeeded")
            client.close()
    finally:
        node.stop()
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
