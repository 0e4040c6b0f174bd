"""One request served by the cluster: the conductor places it, then either one engine prefills and
decodes it (aggregated) or a prefill engine computes its prompt's KV into its node, the
messengers move the pages to the decode node, and the decode engine loads them and generates
(disaggregated).

Per attempt (``Disaggregator.serve``):

1. ``Schedule`` (token ids) at the conductor: a prefill node, a decode node, and maybe a transfer
   plan (the global-cache policy fetching a prefix to the prefill node, when its measured cost
   pays). ``--mode aggregated`` asks for one node of role ``both`` (by cache hit and load) and
   ``--disaggregate-above N`` lets the conductor place a request whose uncached suffix there is
   longer than N tokens disaggregated instead. A rejection (``RESOURCE_EXHAUSTED``, the SLO it
   misses) is HTTP 429; no live node is 503. ``--policy`` names the conductor's policy per
   request.
2. The plan's transfer is awaited (the destination messenger joins the conductor's batch), so the
   engine finds the prefix on its node; the wait is reported to the conductor's cost model.
3. One node for both: the client's request goes to its engine alone (streamed or not), the
   prompt as token ids, and ``Complete`` frees the ledger entry when it is done. Otherwise:
4. Prefill: the prefill node's engine completes the prompt with ``max_tokens=1``; its kvcache
   connector loads the cached prefix and stores the prompt's full blocks on its node before it
   answers. ``Complete(PREFILLED)`` re-anchors the conductor's queue estimate.
5. The decode node's messenger pulls every full block from the prefill node's messenger (pages it
   holds already are not moved); a page that fails to arrive is computed by the decode engine.
6. Decode: the decode node's engine gets the client's request with the prompt as token ids; its
   connector (``kv_consumer``) loads the prefix from its node, so only the last partial block is
   computed, then it generates (streamed or not). ``Complete`` frees the conductor's ledger entry
   whatever happened. The answer's ``usage.prompt_tokens_details.cached_tokens`` is the prefill's
   (the prompt tokens no engine computed), not the decode's load of what the prefill just made.

A completion's prompt is token ids (or text the engines tokenize); a chat's is its messages
rendered by an engine's ``/tokenize`` and sent to the serving engine as those very ids
(``router.chat``).

Retries: an engine that provably never took the work (refused the connection, not connected in
time, answered 503) is retried up to ``retries`` times from step 1 after ``retry_backoff_s``, and
the conductor is told to place the retry on other nodes (``exclude_nodes``). Anything after the
engine took the work (a cut, a stall, a 5xx) is not retried: the request would run twice. A
failure after the first byte of a stream ends the stream with an error event (``app``).

Cancelling ``serve`` (the client left) stops everything in flight: the engine requests are
dropped (vLLM aborts a request whose connection closes), page transfers are cancelled at their
messenger, and the ledger entry is freed (also one whose ``Schedule`` was still on its way).

Blocking gRPC calls run on two thread pools beside the event loop: short calls (conductor,
messenger ``Cancel``) on one, the waits on page transfers (up to ``transfer_timeout_s``) on the
other, so slow pulls never delay a ``Schedule`` or a ``Complete``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import grpc

from clients.conductor_client import schedule_request
from clients.messenger_client import MessengerClient
from clients.remote_pool import HOLD_S
from clients.vllm_identity import rank_keys, salt_of
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout
from proto import conductor_pb2 as cpb
from proto import messenger_pb2 as mpb
from rpc.status import KVCacheRpcError
from rpc.wire import layout_from_pb, transfer_keys

from .catalog import Catalog, ModelInfo
from .conductor_calls import ConductorCalls
from .engines import Engine, EngineClient, EngineError, EngineStream, EngineTimeouts
from .metrics import RouterMetrics
from .protocol import CHAT, COMPLETIONS, Completion, RouterError, check_context

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RouterOptions:
    conductor: str
    engines: tuple[Engine, ...]
    token: str | None = None  # the cluster's admin token (Schedule, messenger transfers)
    tls_ca: str | None = None
    namespace: str | None = None  # default: the one namespace the nodes serve
    ttft_slo_s: float = 0.0  # sent with every Schedule unless a request names its own
    tbt_slo_s: float = 0.0
    transfer_timeout_s: float = 30.0
    retries: int = 1
    retry_backoff_s: float = 1.0
    timeouts: EngineTimeouts = EngineTimeouts()
    max_inflight: int = 256  # completions served at once; more are answered 429
    call_workers: int = 8  # threads for short gRPC calls (Schedule, Prefilled, Complete, Cancel)
    pull_workers: int = 32  # threads waiting on page transfers
    mode: str = "disaggregated"  # or "aggregated": one node of role both per request
    disaggregate_above: int = 0  # aggregated, unless the uncached suffix is longer (0: never)
    policy: str = ""  # the conductor's policy for these requests ("": its own)
    pooled: bool = True  # engine connections kept alive (False: one per request)


MODES = ("aggregated", "disaggregated")
# How long an answer's end waits for the conductor to have its FINISHED (``finished``): a
# batch RPC's time normally, bounded for a conductor that is slow or gone.
REPORT_WAIT_S = 1.0
# The most ranks of one engine whose pages a decode pull moves (a pull per rank); the decode
# engine loads only what all of its ranks hold, so a report of more is pulled in part, never wrong.
MAX_RANKS = 64


@dataclass(kw_only=True)
class Served:
    """What one request went through before its decode, for headers, metrics and benchmarks."""

    request_id: str  # the router's id of the request (the client's X-Request-Id, or its own)
    ledger_id: str = ""  # the conductor's id of this attempt
    attempts: int = 1
    stage: str = "schedule"  # the step under way
    mode: str = ""  # aggregated (one engine) or disaggregated
    cached_tokens: int | None = None  # what the answer's usage says was cached (None: its own)
    transfer_s: float = 0.0  # the wait for the plan's transfer (reported at Complete)
    prefill_node: str = ""
    decode_node: str = ""
    prompt_tokens: int = 0
    reuse_blocks: int = 0  # the conductor's view: prefix the prefill node has (after the plan)
    plan_blocks: int = 0
    prefill_cached_tokens: int = 0  # the prefill engine's report
    pulled_pages: int = 0
    pulled_bytes: int = 0
    held_pages: int = 0  # already on the decode node
    failed_pages: int = 0
    finished: bool = False  # its FINISHED is on its way to the conductor
    started: float = field(default_factory=time.perf_counter)

    def headers(self) -> dict[str, str]:
        return {
            "x-request-id": self.request_id,
            "x-kvcache-request-id": self.ledger_id,
            "x-kvcache-attempts": str(self.attempts),
            "x-kvcache-mode": self.mode,
            "x-kvcache-prefill-node": self.prefill_node,
            "x-kvcache-decode-node": self.decode_node,
            "x-kvcache-reuse-blocks": str(self.reuse_blocks),
            "x-kvcache-plan-blocks": str(self.plan_blocks),
            "x-kvcache-prefill-cached-tokens": str(self.prefill_cached_tokens),
            "x-kvcache-pulled-pages": str(self.pulled_pages),
            "x-kvcache-pulled-bytes": str(self.pulled_bytes),
            "x-kvcache-held-pages": str(self.held_pages),
            "x-kvcache-failed-pages": str(self.failed_pages),
        }


class Disaggregator:
    def __init__(self, options: RouterOptions, metrics: RouterMetrics) -> None:
        if not options.engines:
            raise ValueError("the router needs at least one engine (--engine NODE=URL)")
        self.options = options
        self.metrics = metrics
        self.engines = {e.node: e for e in options.engines}
        if options.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {options.mode!r}")
        self.http = EngineClient(options.timeouts, options.pooled)
        self.catalog = Catalog(self.engines, self.http)
        self.conductor = ConductorCalls(options.conductor, options.token, options.tls_ca)
        self._calls = ThreadPoolExecutor(options.call_workers, thread_name_prefix="router-rpc")
        self._pulls = ThreadPoolExecutor(options.pull_workers, thread_name_prefix="router-pull")
        self._messengers: dict[str, MessengerClient] = {}
        self._lock = threading.Lock()
        self._layouts: dict[str, KVLayout] = {}  # by the model the engines serve
        # The salt of the engines' keys (model, page format; docs/api.md), learned from the
        # prefill engines' answers: what the conductor needs to find the prompt's pages.
        self._salt = b""
        self._model: ModelInfo | None = None
        self._ids = itertools.count()
        self._prefix = f"r{os.getpid():x}-{time.time_ns() & 0xFFFFFF:06x}"

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def close(self) -> None:
        await self.http.close()
        await self.conductor.aclose()
        for pool in (self._pulls, self._calls):
            pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            messengers, self._messengers = list(self._messengers.values()), {}
        for m in messengers:
            m.close()

    async def _run(
        self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None
    ) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            pool or self._calls, functools.partial(fn, *args)
        )

    def _messenger(self, address: str) -> MessengerClient:
        with self._lock:
            client = self._messengers.get(address)
            if client is None:
                client = self._messengers[address] = MessengerClient(
                    address, self.options.token, self.options.tls_ca
                )
            return client

    # ---- what the cluster serves ------------------------------------------------------------

    async def layout(self, model: str) -> KVLayout:
        """The layout whose block keys the engines' connectors store under: the namespace the
        nodes registered with the conductor (``--namespace`` when they serve several; else the
        one of ``model``, the model the engines serve, as a connector registers it)."""
        known = self._layouts.get(model)
        if known is not None:
            return known
        try:
            reply = await self._run(self.conductor.client.list_nodes)
        except KVCacheRpcError as e:
            raise self.conductor.error(e) from None
        layouts = {
            layout.namespace: layout
            for status in reply.nodes
            for layout in (layout_from_pb(x) for x in status.node.layouts)
        }
        wanted = self.options.namespace
        if wanted is not None and wanted not in layouts:
            raise RouterError(
                503, f"no node serves namespace {wanted!r} (served: {sorted(layouts)})"
            )
        if wanted is None and len(layouts) > 1:
            # nodes without a layout serve the demo's beside what their engines registered
            mine = [ns for ns, layout in layouts.items() if layout.model == model]
            wanted = mine[0] if len(mine) == 1 else None
            if wanted is None:
                raise RouterError(
                    503,
                    f"the nodes serve {len(layouts)} namespaces {sorted(layouts)}, "
                    f"{len(mine)} of model {model!r}: start the router with --namespace",
                    "service_unavailable",
                )
        if not layouts:
            raise RouterError(503, "no node serves a layout yet", "service_unavailable")
        layout = layouts[wanted] if wanted else next(iter(layouts.values()))
        self._layouts[model] = layout
        return layout

    # ---- a request --------------------------------------------------------------------------

    async def serve(
        self,
        call: Completion,
        tokens: list[int],
        model: ModelInfo,
        request_id: str,
        own_id: bool = False,
    ) -> tuple[Served, dict[str, Any] | EngineStream]:
        """Run steps 1-5; the decode engine's JSON reply, or its open stream (then ``finish``
        the request once the stream is done). Retries what never reached an engine, on other
        nodes. ``own_id``: ``request_id`` is the router's (``new_request_id``), unique, so the
        conductor's ids of the attempts are made from it; a client's may not be."""
        output_tokens = check_context(call, len(tokens), model.max_model_len)
        base = request_id if own_id else self.new_request_id()
        attempts = 1 + max(self.options.retries, 0)
        failed: list[str] = []  # nodes whose engine failed this request: not asked again
        for attempt in range(1, attempts + 1):
            served = Served(request_id=request_id, ledger_id=f"{base}.{attempt}", attempts=attempt)
            try:
                return served, await self._attempt(
                    call, tokens, model, served, output_tokens, failed
                )
            except EngineError as e:
                if not e.retriable:
                    raise _from_engine(e, served.stage) from None
                failed.append(e.engine.node)
                if attempt == attempts:
                    raise RouterError(
                        502, f"{served.stage} failed: {e} (after {attempt} attempts)", "bad_gateway"
                    ) from None
                log.warning("request %s: %s; retrying without %s", request_id, e, e.engine.node)
                self.metrics.retries.labels(served.stage).inc()
                await asyncio.sleep(self.options.retry_backoff_s)
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        call: Completion,
        tokens: list[int],
        model: ModelInfo,
        served: Served,
        output_tokens: int,
        exclude: list[str],
    ) -> dict[str, Any] | EngineStream:
        layout = await self.layout(model.name)
        reply = await self._schedule(tokens, output_tokens, call, layout, served, exclude)
        try:
            prefill, decode = self._engine(reply.prefill_node), self._engine(reply.decode_node)
            served.stage = "plan"
            t = time.perf_counter()
            for plan in reply.transfers:
                keys = transfer_keys(plan)
                await self._pull(
                    "plan", layout, plan.dst_messenger, plan.src_messenger, keys, served
                )
            if reply.transfers:
                served.transfer_s = time.perf_counter() - t
                self.metrics.stage.labels("plan_wait").observe(served.transfer_s)
            if reply.prefill_node == reply.decode_node:  # one engine prefills and decodes
                served.mode = "aggregated"
                served.stage = "decode"
                return await self._generate(decode, call, tokens, model, served)
            served.mode = "disaggregated"
            served.stage = "prefill"
            t = time.perf_counter()
            out = await self.http.post_json(
                prefill,
                COMPLETIONS,
                {
                    **call.prefill_checked,
                    "model": model.name,
                    "prompt": tokens,
                    "max_tokens": 1,
                    "temperature": 0,
                    # the connector answers with the namespace and salt of the prompt's keys
                    "kv_transfer_params": {"kvcache_keys": True},
                },
                request_id=served.request_id,
            )
            took = time.perf_counter() - t
            self.metrics.stage.labels("prefill").observe(took)
            served.cached_tokens = _cached_tokens(out)
            served.prefill_cached_tokens = served.cached_tokens or 0
            self.metrics.prefill_cached_tokens.inc(served.prefill_cached_tokens)
            self.conductor.report(
                served.ledger_id, cpb.COMPLETE_PHASE_PREFILLED, took, served.transfer_s
            )
            served.transfer_s = 0.0  # reported
            served.stage = "decode_pull"
            root, ranks = self._keys_of(out, layout)
            chain = block_keys(tokens, layout.block_tokens, root)
            t = time.perf_counter()
            # A multi-rank engine stores each rank's share under keys of its own: one pull per
            # rank (a batch's keys are one chain), side by side.
            await asyncio.gather(
                *(
                    self._pull(
                        "decode_pull",
                        layout,
                        reply.decode_messenger,
                        reply.prefill_messenger,
                        rank_keys(chain, tag),
                        served,
                        chain=True,
                    )
                    for tag in ranks
                )
            )
            self.metrics.stage.labels("decode_pull").observe(time.perf_counter() - t)
            served.stage = "decode"
            return await self._generate(decode, call, tokens, model, served)
        except BaseException:
            self.finish(served)
            raise

    async def _generate(
        self, engine: Engine, call: Completion, tokens: list[int], model: ModelInfo, served: Served
    ) -> dict[str, Any] | EngineStream:
        """The client's request at ``engine``, on the prompt's token ids: its open stream
        (``finish`` once it is done), or its answer (finished)."""
        body = {**call.forward, "model": model.name}
        params: dict[str, Any] = {}
        if call.path == CHAT:  # vLLM's chat endpoint takes the rendered ids in place of its own
            params["prompt_token_ids"] = tokens
        else:
            body["prompt"] = tokens
        # Served by one engine before any prefill told the engines' key salt: this answer tells
        # it (the conductor finds no prompt's pages without it), and is not the client's to see.
        layout = self._layouts.get(model.name)
        learn = (
            served.mode == "aggregated"
            and not self._salt
            and not call.stream
            and layout is not None
        )
        if learn:
            params["kvcache_keys"] = True
        if params:
            body["kv_transfer_params"] = params
        if call.stream:
            return await self.http.open_stream(engine, body, served.request_id, call.path)
        result: dict[str, Any] = await self.http.post_json(
            engine,
            call.path,
            body,
            request_id=served.request_id,
            whole_s=self.options.timeouts.decode_s,
        )
        await self.finished(served)
        if learn and layout is not None:
            self._keys_of(result, layout)
            result.pop("kv_transfer_params", None)
        if served.cached_tokens is not None:
            with_cached_tokens(result, served.cached_tokens)
        return result

    def _request_salt(self, call: Completion) -> bytes:
        """The salt the engines' connector gives this request's keys, as far as the router can
        tell it: the engines' salt, with the request's ``cache_salt`` mixed in as the connector
        does (vllm_identity.salt_of). A LoRA adapter's part digests its files, which only the
        engine reads: such a request is scheduled by the engines' salt, a hint (the connector
        decides what is loaded)."""
        cache_salt = call.forward.get("cache_salt")
        if not self._salt or not isinstance(cache_salt, str) or not cache_salt:
            return self._salt
        return salt_of(self._salt, cache_salt)

    def _keys_of(self, prefill: dict[str, Any], layout: KVLayout) -> tuple[bytes, list[str]]:
        """The root of the prompt's keys as the prefill engine's connector reported it, and its
        ranks' tags (``[""]``: one rank, which stores under the chain's keys); its engine salt
        is kept for scheduling the next prompts. The plain namespace root for an engine that
        reports none, or keys of another namespace."""
        plain = root_key(layout.namespace), [""]
        keys = (prefill.get("kv_transfer_params") or {}).get("kvcache") or {}
        try:
            if keys.get("namespace") != layout.namespace:
                return plain
            salt, engine = bytes.fromhex(keys["salt"]), bytes.fromhex(keys["engine"])
            ranks = [str(tag) for tag in keys.get("ranks") or []][:MAX_RANKS] or [""]
        except (KeyError, TypeError, ValueError, AttributeError):
            return plain
        if ranks == [""]:
            # NOTE: the conductor indexes a multi-rank engine's pages under its ranks' keys,
            # which a schedule by the chain's keys never finds: its salt would only cost lookups.
            self._salt = engine
        return root_key(layout.namespace, salt), ranks

    async def _schedule(
        self,
        tokens: list[int],
        output_tokens: int,
        call: Completion,
        layout: KVLayout,
        served: Served,
        exclude: list[str],
    ) -> cpb.ScheduleReply:
        t = time.perf_counter()
        future = self.conductor.schedule(
            schedule_request(
                layout.namespace,
                tokens=tokens,
                salt=self._request_salt(call),
                request_id=served.ledger_id,
                prompt_tokens=len(tokens),
                output_tokens=output_tokens,
                ttft_slo_s=call.ttft_slo_s,
                tbt_slo_s=call.tbt_slo_s,
                exclude_nodes=exclude,
                aggregated=self.options.mode == "aggregated",
                disaggregate_above=self.options.disaggregate_above,
                policy=self.options.policy,
            )
        )
        try:
            reply: cpb.ScheduleReply = await asyncio.shield(future)
        except KVCacheRpcError as e:
            raise self.conductor.error(e) from None
        except asyncio.CancelledError:
            # The conductor may enter it in its ledger still: free it when the call returns.
            future.add_done_callback(functools.partial(self._complete_if_scheduled, served))
            raise
        finally:
            self.metrics.stage.labels("schedule").observe(time.perf_counter() - t)
        served.prefill_node, served.decode_node = reply.prefill_node, reply.decode_node
        served.prompt_tokens = len(tokens)
        served.reuse_blocks = reply.reuse_blocks
        served.plan_blocks = sum(len(transfer_keys(p)) for p in reply.transfers)
        self.metrics.prompt_tokens.inc(len(tokens))
        return reply

    def _complete_if_scheduled(self, served: Served, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.finish(served)

    def _engine(self, node: str) -> Engine:
        engine = self.engines.get(node)
        if engine is None:
            raise RouterError(
                503,
                f"the conductor chose node {node!r}, which has no engine the router knows "
                f"(engines: {', '.join(sorted(self.engines))})",
                "service_unavailable",
            )
        return engine

    async def _pull(
        self,
        kind: str,
        layout: KVLayout,
        dst: str,
        src: str,
        keys: Any,
        served: Served,
        chain: bool = False,
    ) -> None:
        """``dst``'s messenger fetches ``keys`` from ``src``'s (``chain``: a prompt's whole
        chain, in order). A failure is not the request's: the engine computes what did not
        arrive. Cancelled, the batch is cancelled too."""
        keys = list(keys)
        if not keys or not dst or not src:
            return
        messenger = self._messenger(dst)
        timeout_s = self.options.transfer_timeout_s
        try:
            # held: the pages stay pinned on the engine's node until its first steps load them
            submitted = self._calls.submit(
                messenger.submit, layout.namespace, [(k, src) for k in keys], chain, True, HOLD_S
            )
            try:
                batch: mpb.SubmitTransferReply = await asyncio.wrap_future(submitted)
            except asyncio.CancelledError:
                submitted.add_done_callback(functools.partial(self._cancel_batch, messenger))
                raise
            try:
                status: mpb.TransferStatusReply = await self._run(
                    messenger.status, batch.batch_id, True, timeout_s, pool=self._pulls
                )
            except asyncio.CancelledError:
                self._calls.submit(self._cancel_quietly, messenger, batch.batch_id, True)
                raise
            if not status.finished:
                self._calls.submit(self._cancel_quietly, messenger, batch.batch_id)
                raise KVCacheRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"not done after {timeout_s:g} s (cancelled)",
                    "TransferStatus",
                )
        except KVCacheRpcError as e:
            log.warning("%s %s -> %s of %d pages failed: %s", kind, src, dst, len(keys), e)
            self.metrics.kv_pages.labels(kind, "failed").inc(len(keys))
            if kind == "decode_pull":
                served.failed_pages += len(keys)
            return
        moved = status.bytes_moved // layout.page_bytes
        held = status.done - moved
        self.metrics.kv_bytes.labels(kind).inc(status.bytes_moved)
        self.metrics.kv_pages.labels(kind, "moved").inc(moved)
        self.metrics.kv_pages.labels(kind, "held").inc(held)
        self.metrics.kv_pages.labels(kind, "failed").inc(status.failed)
        if kind == "decode_pull":
            served.pulled_pages, served.pulled_bytes = moved, status.bytes_moved
            served.held_pages, served.failed_pages = held, status.failed

    def _cancel_batch(
        self, messenger: MessengerClient, future: concurrent.futures.Future[Any]
    ) -> None:
        if not future.cancelled() and future.exception() is None:
            self._cancel_quietly(messenger, future.result().batch_id, True)

    def _cancel_quietly(
        self, messenger: MessengerClient, batch_id: str, left: bool = False
    ) -> None:
        """Cancel a transfer batch (``left``: because its client left)."""
        try:
            messenger.cancel(batch_id)
            if left:
                self.metrics.cancelled.labels("pull").inc()
        except KVCacheRpcError as e:  # it times out on its own (transfer_timeout_s)
            log.info("Cancel(%s) at %s failed: %s", batch_id, messenger.address, e)

    def finish(self, served: Served) -> concurrent.futures.Future[None] | None:
        """Free the conductor's ledger entry (on the pool: also from a cancelled request), with
        the wait for its transfer plan if not reported yet; once per request."""
        if served.finished:
            return None
        served.finished = True
        return self.conductor.report(
            served.ledger_id, cpb.COMPLETE_PHASE_FINISHED, 0.0, served.transfer_s
        )

    async def finished(self, served: Served) -> None:
        """``finish``, and wait (at most ``REPORT_WAIT_S``) until the conductor has it: called
        before a request's answer ends, so that the client's next request (a conversation's
        next turn) is scheduled with this one gone from its node's queue, not counted there
        still (it would be sent elsewhere, its prefix moved or recomputed). Never fails."""
        future = self.finish(served)
        if future is None:
            return
        with suppress(Exception):  # a failed Complete is logged; the entry expires by itself
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), REPORT_WAIT_S)


def _cached_tokens(reply: Any) -> int | None:
    try:
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
    except (KeyError, TypeError, ValueError):
        return None  # the engine runs without --enable-prompt-tokens-details


def with_cached_tokens(reply: Any, cached: int) -> None:
    """Set ``usage.prompt_tokens_details.cached_tokens`` of an answer (or a stream's usage
    event) that has a usage."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if not isinstance(details, dict):
            details = usage["prompt_tokens_details"] = {}
        details["cached_tokens"] = cached


def _from_engine(e: EngineError, stage: str) -> RouterError:
    """An engine's 4xx goes to the client as the engine said it; anything else after the
    engine took the request is a 502 (not retried: it would run twice)."""
    if 400 <= e.status < 500:
        return RouterError(e.status, str(e), body=e.body)
    return RouterError(502, f"{stage} failed: {e}", "bad_gateway")
