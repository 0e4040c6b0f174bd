"""The ground for everything gRPC: channels, servers, status codes, and the wire formats.

- ``rpc.channel``: ``make_channel`` (bearer token, TLS, message-size limits);
- ``rpc.server``: ``serve`` and its parts (auth, TLS, health, reflection, metrics, ready line,
  signals);
- ``rpc.status``: domain exceptions <-> gRPC status codes, both ways;
- ``rpc.cluster``: what a node tells the conductor (descriptor, load, tier usage);
- ``rpc.wire``: every conversion between proto messages and those dataclasses.

It imports only ``kvstore`` and ``proto``; everything above imports it.
"""
