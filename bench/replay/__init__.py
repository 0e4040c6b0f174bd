"""The cache-hit benchmarking tool on traces: reading traces, ``kvcache bench hitrate`` (the
kvstore alone), ``schedule`` (the scheduler in simulated time), ``live`` (a running cluster, with
emulated engines) and ``serve`` (the router and real vLLM engines)."""
