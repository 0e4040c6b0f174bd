"""Cluster plumbing: how kvcache's role processes start, find each other and where they run.

- ``plumbing.launch``: starting role processes and waiting for their ready line
  (``start_service``), stopping them, and the shared memory a process group left behind;
- ``plumbing.etcd``: the etcd v3 client (keys, leases, watches, election);
- ``plumbing.registration``: the member side of membership: the records under the etcd prefix
  and ``Registration`` (a record kept alive under a lease);
- ``plumbing.netns``: hosts as network namespaces on a bridge, links shaped with ``tc``.

It sits above ``rpc`` (a membership record carries a node's descriptor in its wire form) and
below the roles: nodes and messengers register, the conductor watches, clients find the leader,
``kvcache up`` launches them all.
"""
