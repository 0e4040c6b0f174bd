"""A real vLLM engine (CPU, tiny model) in a process of its own, driven one JSON line at a time:
the connector tests run several scenarios on one engine, and act on the node (stop it, remove a
page) between calls. Run as a script, this file is the engine's side.

    with Engine(model, {"node": address}, prefix_caching=False) as e:
        (out,) = e.generate([{"tokens": PROMPT, "cache_salt": "a"}])
        out["tokens"], out["cached"], out["kvcache"]  # kvcache: the keys' namespace and salt

Spec keys (``Engine(**spec)``): ``connector`` (kv_connector_extra_config; None: no connector),
``kv_role``, ``connector_class`` / ``connector_module`` (a subclass in tests/), ``prefix_caching``
(default false: every run asks the connector), ``max_model_len``, ``kv_cache_bytes``,
``max_num_seqs``, ``loras`` ({name: path}), ``engine`` (more ``LLM`` keyword arguments),
``env`` (the engine's extra environment).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import vllm_zygote

from plumbing.launch import group_shm, release_shm

MARK = "@@vllm-driver "
HERE = os.path.dirname(os.path.abspath(__file__))


class Engine:
    def __init__(self, model: str, connector: dict | None = None, *, log_path: str, **spec: Any):
        self.log_path = log_path
        # Deadlines a loaded test machine does not outlast (the breaker tests set their own),
        # fixed (not following the node's latency down): a node call slower than its deadline
        # would make a lookup or a save a miss.
        env = {
            **os.environ,
            "KVCACHE_CONNECTOR_TIMEOUT_MS": "10000",
            "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS": "10000",
            # the conductor's Locate too (100 ms: on two loaded cores a pull was at times
            # a miss; the test that a dead conductor costs a miss sets its own)
            "KVCACHE_CONNECTOR_REMOTE_TIMEOUT_MS": "10000",
            **spec.pop("env", {}),
        }
        root = os.path.dirname(HERE)
        env["PYTHONPATH"] = os.pathsep.join([root, HERE, env.get("PYTHONPATH", "")])
        self._log = open(log_path, "w")
        # A fork of a process that imported vLLM already (tests/vllm_zygote.py), in a session
        # of its own (workers of a multi-process engine are in its group).
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.proc = vllm_zygote.spawn(env, in_r, out_w, self._log.fileno())
        finally:
            os.close(in_r)
            os.close(out_w)
        self._stdin = os.fdopen(in_w, "w")
        self._stdout = os.fdopen(out_r)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._call({"model": model, "connector": connector, **spec}, timeout=300)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        """Replies to the queue; vLLM's own output (it logs to stdout) to the log."""
        with open(self.log_path + ".stdout", "w") as out:
            for line in self._stdout:
                if line.startswith(MARK):
                    self._lines.put(line[len(MARK) :])
                else:
                    out.write(line)
                    out.flush()
        self._lines.put(None)

    def _call(self, cmd: dict, timeout: float = 300) -> Any:
        self._stdin.write(json.dumps(cmd) + "\n")
        self._stdin.flush()
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"the engine did not answer in {timeout} s:\n{self.log()}"
            ) from None
        if line is None:
            raise AssertionError(f"the engine exited ({self.proc.wait()}):\n{self.log()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"engine: {reply['error']}\n{self.log()}")
        return reply

    def log(self, chars: int = 6000) -> str:
        """The ends of the engine's stderr and stdout."""
        self._log.flush()
        tails = []
        for path in (self.log_path, self.log_path + ".stdout"):
            try:
                with open(path, errors="replace") as f:
                    tails.append(f.read()[-chars:])
            except OSError:
                pass
        return "\n".join(tails)

    def generate(self, prompts: list, max_tokens: int = 8) -> list[dict]:
        """Greedy outputs; a prompt is token ids or ``{"tokens", "cache_salt", "lora", "image",
        "kv_transfer_params"}`` (``image``: the seed of a random image, for a multimodal model;
        ``kv_transfer_params``: the request's, as vLLM's P/D proxies send them)."""
        items = [p if isinstance(p, dict) else {"tokens": p} for p in prompts]
        return self._call({"op": "generate", "prompts": items, "max_tokens": max_tokens})["outputs"]

    def reset(self, connector: bool = True) -> bool:
        """vLLM's ``reset_prefix_cache``: its own cache emptied, and with ``connector`` the
        connector's too (a new key epoch); without, the next request asks the connector again
        as a fresh engine's would."""
        return bool(self._call({"op": "reset", "connector": connector})["ok"])

    def stats(self) -> dict:
        """The connector's cumulative counters in the engine's process (``STATS``)."""
        return dict(self._call({"op": "stats"})["stats"])

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics of the connector (``vllm:kvcache_*``), summed over labels."""
        return dict(self._call({"op": "metrics"})["metrics"])

    def close(self) -> None:
        """Ends the engine (its stdin closed), and what is left of its process group (workers
        of a multi-process engine, multiprocessing's resource tracker) once given time to
        clean up after it. Then the shared memory its processes held and could not unlink
        (workers killed: the TP ranks' ``vllm_dist_*cpushm_*``) is removed."""
        pids, names = group_shm(self.proc.pid)
        if self.proc.poll() is None:
            try:
                self._stdin.close()
                self.proc.wait(60)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
        self.proc.wait()
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        release_shm(pids, names)
        self._log.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the engine's side ---------------------------------------------------------------------------


def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _engine(spec: dict) -> Any:
    from vllm import LLM

    max_len = spec.get("max_model_len", 1024)
    kw: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_len,
        block_size=32,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=spec.get("max_num_seqs", 4),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", max_len),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        enable_prefix_caching=spec.get("prefix_caching", False),
        disable_log_stats=False,
    )
    if spec.get("loras"):
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    kw.update(spec.get("engine", {}))
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": spec.get("connector_class", "KVCacheConnector"),
            "kv_connector_module_path": spec.get("connector_module", "clients.vllm_connector"),
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_connector_extra_config": spec["connector"],
        }
    return LLM(**kw)


def _image(seed: int) -> Any:
    """A 56x56 RGB image of random pixels (the size of bench.engines.models' BLIP-2)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), np.uint8))


def _generate(llm: Any, spec: dict, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    loras = spec.get("loras") or {}
    ids = {name: i + 1 for i, name in enumerate(sorted(loras))}

    def sampling(extra: dict[str, Any]) -> Any:
        return SamplingParams(
            max_tokens=cmd["max_tokens"],
            temperature=0,
            extra_args={"kv_transfer_params": {"kvcache_keys": True, **extra}},
        )

    params: Any = sampling({})
    if any(p.get("kv_transfer_params") for p in cmd["prompts"]):
        params = [sampling(p.get("kv_transfer_params") or {}) for p in cmd["prompts"]]
    prompts, lora_requests = [], []
    for p in cmd["prompts"]:
        prompt: dict[str, Any] = {"prompt_token_ids": p["tokens"]}
        if p.get("cache_salt"):
            prompt["cache_salt"] = p["cache_salt"]
        if p.get("image") is not None:
            prompt["multi_modal_data"] = {"image": _image(p["image"])}
        prompts.append(prompt)
        name = p.get("lora")
        lora_requests.append(LoRARequest(name, ids[name], loras[name]) if name else None)
    res = llm.generate(
        prompts, params, use_tqdm=False, lora_request=lora_requests if loras else None
    )
    return {
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens or 0,
                "kvcache": (o.kv_transfer_params or {}).get("kvcache"),
                "kv_transfer_params": o.kv_transfer_params,
            }
            for o in res
        ]
    }


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from dataclasses import asdict

    llm = _engine(spec)
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "generate":
                _reply(_generate(llm, spec, cmd))
            elif cmd["op"] == "reset":
                _reply({"ok": llm.reset_prefix_cache(reset_connector=cmd.get("connector", True))})
            elif cmd["op"] == "stats":
                from clients.vllm_stats import REMOTE_LOAD, STATS

                _reply({"stats": {**asdict(STATS), "remote_loads": len(REMOTE_LOAD)}})
            elif cmd["op"] == "metrics":
                sums: dict[str, float] = {}
                for m in llm.get_metrics():
                    if m.name.startswith("vllm:kvcache_") and hasattr(m, "count"):  # histogram
                        name = m.name + "_count"
                        sums[name] = sums.get(name, 0.0) + float(m.count)
                    elif m.name.startswith("vllm:kvcache_"):
                        sums[m.name] = sums.get(m.name, 0.0) + float(getattr(m, "value", 0))
                _reply({"metrics": sums})
            else:
                _reply({"error": f"unknown op {cmd['op']!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            import traceback

            _reply({"error": f"{e!r}\n{traceback.format_exc()}"})


if __name__ == "__main__":
    main()
