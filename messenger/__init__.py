"""The messenger: one process per node that moves KV pages between nodes.

Layers, each calling only the one below:
- ``service.py`` / ``cli.py``: ``MessengerService`` over gRPC (``kvcache messenger``);
- ``mover.py``: batches, dedup of keys in flight, allocate -> fetch -> commit on this node;
- ``node_access.py``: this node's DRAM slabs (mapped by name) and the node-backed page source;
- ``transport.py``: the transport interface; ``tcp.py`` (raw sockets, lanes, pipelining) and
  ``rdma.py`` (one-sided READs over a ``verbs.py`` backend) implement it; ``select.py`` picks;
- ``data_server.py`` / ``frames.py``: the source side of the data port and its wire format;
  ``pin_budget.py``: how much of the node's pool its peers may hold pinned at once.
"""
