"""Benchmarks of a cluster under faults: ``kvcache bench soak`` (processes SIGKILLed under load,
no page lost) and ``kvcache bench failover`` (what a conductor failover costs)."""
