"""The router: an OpenAI-compatible HTTP front end that serves each completion disaggregated,
prefill and decode on different nodes' vLLM engines, the KV cache moved between them by kvcache
(``kvcache router``; see ``disagg.py`` for one request's path)."""
