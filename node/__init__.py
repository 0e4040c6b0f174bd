"""The node server: one host's tiered KV block pools behind gRPC (``kvcache node``)."""
