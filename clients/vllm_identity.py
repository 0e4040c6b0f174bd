"""What a vLLM engine's page keys are made of: the model's identity, the page byte format, the
request's own cache identity (cache_salt, LoRA adapter, multimodal inputs) and the rank.

Keys are the common token chain (``kvstore.keys.block_keys``) rooted in
``root_key(namespace, salt)``, where ``salt`` digests everything besides the token ids that the
KV depends on, as vLLM's own block hashes do (``vllm.v1.core.kv_cache_utils``):

- the model: its config and weight files (names, sizes and sampled bytes), or the hub revision
  (``model_fingerprint``), and the draft model's for speculative decoding;
- the page byte format: vLLM's version, device, attention backend, KV dtype and block shape, as
  each worker reports them (``page_format``): vLLM's pages are backend-specific bytes, never
  shared with the torch or SGLang clients' pages of the same layout;
- the connector's ``salt`` and an epoch that ``reset_cache`` renews;
- per request: vLLM's ``cache_salt`` and the LoRA adapter (name and files), which vLLM mixes
  into every block; multimodal inputs (their hash and position in a page) from the first page
  they touch on, as vLLM does per block.

Requests with prompt embeddings are not cached (``request_salt`` returns None). Ranks of a
tensor- or pipeline-parallel engine each hold their own share of a page: their keys are the
chain's keys derived once more with the rank (``rank_keys``), so no two ranks share a key.

vLLM's own block hashes are not used: they are per-process random for xxhash, not computable by
the router or the conductor from token ids, and at vLLM's block size rather than ours.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any, Sequence

import xxhash

from kvstore.keys import BlockKey, block_keys, derive_keys

if TYPE_CHECKING:
    from vllm.config import ModelConfig

_DOMAIN = b"kvcache/vllm/v1\x00"
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json")
_SAMPLES = 32  # sampled windows per weight file (besides its size and its last window)
_WINDOW = 64 << 10


def _parts(*parts: bytes | str) -> bytes:
    """Length-prefixed parts: no two different part lists give the same bytes."""
    out = bytearray()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def digest(*parts: bytes | str) -> bytes:
    return xxhash.xxh3_128_digest(_DOMAIN + _parts(*parts))


def files_fingerprint(paths: Sequence[str]) -> str:
    """Names, sizes and sampled bytes of files: cheap for a many-GiB checkpoint, and a
    fine-tune of the same architecture changes the sampled bytes."""
    h = xxhash.xxh3_128()
    for path in sorted(paths):
        size = os.path.getsize(path)
        h.update(_parts(os.path.basename(path), str(size)))
        with open(path, "rb") as f:
            if size <= (_SAMPLES + 1) * _WINDOW:
                h.update(f.read())
                continue
            step = (size - _WINDOW) // _SAMPLES
            for i in range(_SAMPLES):
                f.seek(i * step)
                h.update(f.read(_WINDOW))
            f.seek(size - _WINDOW)
            h.update(f.read(_WINDOW))
    return h.hexdigest()


def dir_fingerprint(path: str) -> str | None:
    """The files of a local model or adapter directory (or a single weight file)."""
    if os.path.isfile(path):
        return files_fingerprint([path])
    if not os.path.isdir(path):
        return None
    files = [f for pat in _WEIGHTS for f in glob.glob(os.path.join(path, pat))]
    config = os.path.join(path, "config.json")
    for extra in (config, os.path.join(path, "adapter_config.json")):
        if os.path.isfile(extra):
            files.append(extra)
    return files_fingerprint(sorted(set(files)))


def _config_digest(model_config: "ModelConfig") -> str:
    """The architecture as vLLM loaded it, without paths or library versions."""
    try:
        cfg = model_config.hf_config.to_dict()
    except Exception:  # noqa: BLE001 - a config object without to_dict: its repr
        return digest(repr(model_config.hf_config)).hex()
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "transformers_version"}
    return digest(json.dumps(cfg, sort_keys=True, default=str)).hex()


def model_fingerprint(model_config: "ModelConfig") -> str:
    """The identity of the weights vLLM serves: their files where they are local (the hub cache
    included), else the hub id and revision; and the config as loaded."""
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    local = dir_fingerprint(model)
    if local is None:
        try:
            from huggingface_hub import snapshot_download

            local = dir_fingerprint(
                snapshot_download(model, revision=revision, local_files_only=True)
            )
        except Exception:  # noqa: BLE001 - not in the local hub cache: name and revision
            local = None
    weights = local or f"hub:{model}@{revision or 'main'}"
    return digest(weights, _config_digest(model_config)).hex()


_ADAPTERS: dict[tuple[str, float], str] = {}


def adapter_fingerprint(path: str) -> str:
    """A LoRA adapter's files (cached per path and modification time), else its path."""
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return f"path:{path}"
    key = (path, mtime)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = dir_fingerprint(path) or f"path:{path}"
    return _ADAPTERS[key]


def page_format(
    vllm_version: str, device: str, backend: str, dtype: str, cache_dtype: str, block_shape: Any
) -> str:
    """How one vLLM block of one layer is laid out in bytes: pages of different formats never
    share keys."""
    major_minor = ".".join(vllm_version.split(".")[:2])
    shape = "x".join(str(int(d)) for d in block_shape)
    return f"vllm{major_minor}|{device}|{backend}|{dtype}|{cache_dtype}|{shape}"


def engine_salt(config_salt: str, model: str, formats: Sequence[str], epoch: bytes) -> bytes:
    """The salt of an engine's keys (requests without cache_salt, LoRA or multimodal inputs)."""
    return digest(b"engine", config_salt, model, *sorted(set(formats)), epoch)


def request_salt(engine: bytes, request: Any) -> bytes | None:
    """The salt of one request's keys, or None when its KV must not be cached (prompt
    embeddings: the KV depends on vectors, not on the token ids the keys hash)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    adapter = (lora.lora_name, adapter_fingerprint(lora.lora_path)) if lora is not None else None
    return salt_of(engine, getattr(request, "cache_salt", None), adapter)


def salt_of(engine: bytes, cache_salt: str | None, adapter: tuple[str, str] | None = None) -> bytes:
    """The salt of keys of an engine (its salt ``engine``) for a request with vLLM's
    ``cache_salt`` and a LoRA adapter (name, ``adapter_fingerprint``): what the router computes
    to schedule a request with ``cache_salt`` where its pages are."""
    parts: list[bytes | str] = []
    if cache_salt:
        parts += [b"cache_salt", cache_salt]
    if adapter is not None:
        parts += [b"lora", *adapter]
    return engine if not parts else digest(b"request", engine, *parts)


def _mm_extras(mm_features: Any, page_tokens: int) -> dict[int, list[tuple[str, int]]]:
    """Per page index: the multimodal items it holds part of, with their offset in the page
    (vLLM's extra keys: identifier and offset relative to the block's first token)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for f in mm_features or ():
        pos = f.mm_position
        if pos.length <= 0:
            continue
        first, last = pos.offset // page_tokens, (pos.offset + pos.length - 1) // page_tokens
        for p in range(first, last + 1):
            out.setdefault(p, []).append((str(f.identifier), pos.offset - p * page_tokens))
    return out


def request_keys(
    tokens: Sequence[int], page_tokens: int, root: bytes, mm_features: Any = None
) -> list[BlockKey]:
    """Keys of the full pages of ``tokens``: the common chain, with a page that holds part of a
    multimodal item chained from a parent that names the item and its offset (so every later
    page differs too, as in vLLM's block hashes). Pages before the first item are plain."""
    n = len(tokens) // page_tokens
    extras = {p: e for p, e in _mm_extras(mm_features, page_tokens).items() if p < n}
    if not extras:
        return block_keys(tokens[: n * page_tokens], page_tokens, root) if n else []
    keys: list[BlockKey] = []
    parent = root
    start = 0
    for p in sorted(extras):
        if p > start:  # the plain run before this page, one chain call
            keys += block_keys(
                tokens[start * page_tokens : p * page_tokens], page_tokens, root, parent
            )
            parent = keys[-1]
        mixed = digest(b"mm", parent, *(f"{ident}@{off}" for ident, off in extras[p]))
        keys += block_keys(
            tokens[p * page_tokens : (p + 1) * page_tokens], page_tokens, root, mixed
        )
        parent, start = keys[-1], p + 1
    if start < n:
        keys += block_keys(tokens[start * page_tokens : n * page_tokens], page_tokens, root, parent)
    return keys


def rank_tag(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """A rank's name in its keys; empty for a single-rank engine, whose keys are the chain's."""
    if tp_size * pp_size == 1:
        return ""
    return f"tp{tp_rank}/{tp_size}|pp{pp_rank}/{pp_size}"


def rank_keys(keys: Sequence[bytes], tag: str) -> list[BlockKey]:
    """The keys one rank stores its share of the pages under."""
    if not tag:
        return list(keys)  # type: ignore[arg-type]
    return derive_keys(keys, b"kvcache/vllm/rank/" + tag.encode() + b"\x00")
