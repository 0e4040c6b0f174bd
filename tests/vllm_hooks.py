"""Connector subclasses that make a fault happen at an exact point of vLLM's step, for the
tests (loaded by real engines through ``kv_connector_module_path``)."""

from __future__ import annotations

import os
from typing import Any

from clients.vllm_connector import KVCacheConnector


class VanishingConnector(KVCacheConnector):
    """Removes page ``KVCACHE_VANISH_PAGE`` of the first request the node has pages for from
    the node right after the scheduler's Lookup, i.e. before the worker's Acquire: as if another
    writer had evicted it meanwhile. Once per engine."""

    vanished = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        page = int(os.environ.get("KVCACHE_VANISH_PAGE", "-1"))
        st = self._reqs.get(request.request_id)
        if n and st is not None and 0 <= page < len(st.keys) and not VanishingConnector.vanished:
            VanishingConnector.vanished = True
            assert self.client.remove(self.namespace, keys=[st.keys[page]]) == 1
        return n, load_async
