"""``kvcache bench``: one sub-package per job, ``cli.py`` dispatching the commands by name.

- ``bench.replay``: the cache-hit tool users run on their traces (trace reading, ``hitrate``,
  ``schedule``, ``live`` with its emulated engines, ``serve``);
- ``bench.micro``: micro-benchmarks against raw references and peers (``store``, ``node``,
  ``transfer``, ``conductor``, ``layerwise``, ``torch``, ``vllm``, the empty-RPC floor, the
  peer runners);
- ``bench.faults``: a cluster under faults (``soak``, ``failover``);
- ``bench.engines``: the random-weight models and the real vLLM engine runner that the vLLM
  benches and tests share;
- ``bench.report``: tables, JSON, plots, progress and sizes, for all of them.
"""
