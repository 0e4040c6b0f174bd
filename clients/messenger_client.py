"""A small client of ``MessengerService`` (used by the conductor hook, tests and tools)."""
from __future__ import annotations

from typing import Any, Iterable

from proto import messenger_pb2 as pb
from proto import messenger_pb2_grpc as pbg
from rpc.channel import make_channel
from rpc.status import call


class MessengerClient:
    def __init__(self, address: str, token: str | None = None, tls_ca_file: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = make_channel(address, token, tls_ca_file)
        self._stub = pbg.MessengerServiceStub(self._channel)

    def _call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        return call(getattr(self._stub, name), name, request, timeout=timeout_s or self.timeout_s)

    def info(self) -> pb.MessengerInfo:
        return self._call("GetInfo", pb.MessengerInfoRequest())

    def submit(self, namespace: str, entries: Iterable[tuple[bytes, str]]
               ) -> pb.SubmitTransferReply:
        """``entries``: (key, source messenger gRPC address) pairs."""
        return self._call("SubmitTransfer", pb.SubmitTransferRequest(
            namespace=namespace,
            entries=[pb.TransferEntry(key=k, source=s) for k, s in entries]))

    def status(self, batch_id: str, wait: bool = False, timeout_s: float = 30.0
               ) -> pb.TransferStatusReply:
        return self._call("TransferStatus", pb.TransferStatusRequest(
            batch_id=batch_id, wait=wait, timeout_s=timeout_s),
            timeout_s=timeout_s + 10 if wait else None)

    def cancel(self, batch_id: str) -> pb.TransferStatusReply:
        return self._call("Cancel", pb.CancelRequest(batch_id=batch_id))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "MessengerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
