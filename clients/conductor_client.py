"""``ConductorClient``: a small typed client for ``ConductorService`` (front ends, tests, bench).

Errors raise ``KVCacheRpcError`` with the server's status code and message (for example
RESOURCE_EXHAUSTED naming the SLO that cannot be met)."""

from __future__ import annotations

from typing import Any, Sequence

from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from rpc.channel import check_health, make_channel
from rpc.status import call
from rpc.wire import selector_to_pb


def selector(
    namespace: str, keys: Sequence[bytes] | None = None, tokens: Any = None, salt: bytes | str = b""
) -> cpb.BlockSelector:
    """A BlockSelector from keys or token ids (tokens travel as packed little-endian uint32)."""
    return selector_to_pb(namespace, keys, tokens, salt)


class ConductorClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca_file: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self._channel = make_channel(address, token, tls_ca_file)
        # NOTE: the generated *_pb2_grpc.py stubs carry no annotations (replies are Any).
        self.stub = pbg.ConductorServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self.timeout_s = timeout_s

    def schedule(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        request_id: str = "",
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        ttft_slo_s: float = 0.0,
        tbt_slo_s: float = 0.0,
    ) -> pb.ScheduleReply:
        reply: pb.ScheduleReply = call(
            self.stub.Schedule,
            "Schedule",
            pb.ScheduleRequest(
                request_id=request_id,
                blocks=selector_to_pb(namespace, keys, tokens, salt),
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                ttft_slo_s=ttft_slo_s,
                tbt_slo_s=tbt_slo_s,
            ),
            timeout=self.timeout_s,
        )
        return reply

    def schedule_batch(self, requests: Sequence[pb.ScheduleRequest]) -> list[pb.ScheduleOutcome]:
        """One outcome per request, in order (``code`` 0: ``reply`` is set)."""
        return list(
            call(
                self.stub.ScheduleBatch,
                "ScheduleBatch",
                pb.ScheduleBatchRequest(requests=requests),
                timeout=self.timeout_s,
            ).outcomes
        )

    def prefilled(self, request_id: str, prefill_seconds: float = 0.0) -> None:
        call(
            self.stub.Complete,
            "Complete",
            pb.CompleteRequest(
                request_id=request_id,
                phase=pb.COMPLETE_PHASE_PREFILLED,
                prefill_seconds=prefill_seconds,
            ),
            timeout=self.timeout_s,
        )

    def complete(self, request_id: str) -> None:
        call(
            self.stub.Complete,
            "Complete",
            pb.CompleteRequest(request_id=request_id, phase=pb.COMPLETE_PHASE_FINISHED),
            timeout=self.timeout_s,
        )

    def list_nodes(self) -> pb.ListNodesReply:
        reply: pb.ListNodesReply = call(
            self.stub.ListNodes, "ListNodes", pb.ListNodesRequest(), timeout=self.timeout_s
        )
        return reply

    def locate(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
    ) -> dict[str, int]:
        """Node id -> how many leading blocks it holds."""
        reply = call(
            self.stub.Locate,
            "Locate",
            selector_to_pb(namespace, keys, tokens, salt),
            timeout=self.timeout_s,
        )
        return {n.node_id: n.blocks for n in reply.nodes}

    def health(self) -> str:
        """gRPC health: "SERVING", "NOT_SERVING", or why the check failed ("UNAVAILABLE")."""
        return check_health(self._channel, min(self.timeout_s, 5.0))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ConductorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
