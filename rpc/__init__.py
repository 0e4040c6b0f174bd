"""The ground for everything gRPC: channels, servers, status codes, and the wire formats.

- ``rpc.channel``: ``make_channel`` (bearer token, TLS, message-size limits);
- ``rpc.server``: ``serve`` and its parts (auth, TLS, health, reflection, metrics, ready line,
  signals; ``logs``, ``build``);
- ``rpc.status``: domain exceptions <-> gRPC status codes, both ways;
- ``rpc.streams``: caps and idle deadlines on streaming RPCs;
- ``rpc.tls``: a local CA for a cluster's links;
- ``rpc.cluster``: what a node tells the conductor (descriptor, load, tier usage);
- ``rpc.wire``: every conversion between proto messages and those dataclasses.

It imports only ``kvstore`` and ``proto``; everything above imports it. Starting processes,
etcd and network namespaces are ``plumbing``'s, one floor up.
"""
