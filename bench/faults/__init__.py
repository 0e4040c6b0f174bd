"""Benchmarks of a cluster under faults: ``kvcache bench soak`` (processes SIGKILLed under load,
no page lost), ``kvcache bench failover`` (what a conductor failover costs), and ``python -m
bench.faults.vllm_stall`` (a real vLLM engine whose node hangs, against one without the
connector)."""
