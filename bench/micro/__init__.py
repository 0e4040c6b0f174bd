"""Micro-benchmarks, each against a raw reference or a peer measured in the same run:
``kvcache bench store | node | transfer | conductor | layerwise | torch | vllm``, the empty-RPC
floor (``rpc_floor``) and the runners of the peer stores (``peers``, ``mooncake_rounds``)."""
