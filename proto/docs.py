"""Render docs/api.md from proto/*.proto: ``python -m proto.docs``.

Each service becomes a table of its RPCs (with the comments written above them in the .proto),
followed by the full proto source for the messages. ``tests/test_proto_generated.py`` fails when
docs/api.md is stale.
"""

from __future__ import annotations

import re
import sys

from proto.generate import ROOT, proto_files

DOC = ROOT / "docs" / "api.md"
_RPC = re.compile(
    r"rpc\s+(\w+)\s*\(\s*(stream\s+)?([\w.]+)\s*\)\s*returns\s*\(\s*(stream\s+)?"
    r"([\w.]+)\s*\)"
)


def _services(text: str) -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    services, current, comment = [], None, []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("service "):
            current = (line.split()[1], [])
            services.append(current)
            comment = []
        elif line.startswith("//"):
            comment.append(line[2:].strip())
        elif current is not None and (m := _RPC.search(line)):
            req = ("stream " if m.group(2) else "") + m.group(3)
            rep = ("stream " if m.group(4) else "") + m.group(5)
            current[1].append((m.group(1), req, rep, " ".join(comment)))
            comment = []
        elif line == "}":
            current, comment = None, []
        elif not line.startswith("//"):
            comment = []
    return services


# How any engine computes the keys every kvcache client uses (tests/test_kvstore_keys.py checks an
# implementation written from this text against kvstore.keys).
KEYS = """## Block keys

A block is `block_tokens` consecutive prompt tokens; only full blocks have keys. Every client (the
Python client, the torch client, the vLLM connector, the conductor) names a block by the same
16-byte key, so a prefix stored through one is found through all of them:

- **namespace**: the layout fingerprint
  `{model}|L{num_layers}|H{kv_heads}|D{head_dim}|{dtype}|B{block_tokens}`, UTF-8
  (e.g. `llama3-8b|L32|H8|D128|bfloat16|B256`).
- **root** = `xxh3_128(b"kvcache/root/v1\\x00" + u32le(len(namespace)) + namespace + salt)`,
  where `salt` is the request's cache salt as bytes (empty by default) and `u32le` a 4-byte
  little-endian length.
- **key of block i** = `xxh3_128(parent + tokens_i)`, where `parent` is the root for block 0 and
  the key of block i-1 after it, and `tokens_i` is the block's token ids as little-endian
  `uint32`, `4 * block_tokens` bytes. Digests are the 16 bytes of `xxh3_128` (seed 0) in
  the byte order of `xxhash.xxh3_128_digest` (big-endian of the 128-bit value).

Servers scope keys to the caller's tenant before storing them (`xxh3_128(b"kvcache/tenant/" +
tenant + b"\\x00" + key)`), so a client always sends and receives keys as computed above; the
admin token (tenant "") sees keys unscoped. Selectors may carry token ids instead of keys
(`token_bytes`: packed little-endian `uint32`); the server then computes the keys itself.

### SGLang HiCache keys

The SGLang backend (`clients/sglang_hicache.py`) does not use the token chain: SGLang names each
page by its own chained hash (a 64-hex string over the tokens, `extra_key` and `cache_salt`), and
every rank of an engine holds its own share of that page. The key of a page is
`xxh3_128(b"sglang/page/v2\\x00" + identity + b"\\x00" + page_hash)`, with `identity` the UTF-8
of `model=M|dtype=D|layout=L|page=T:B:S|share=R|epoch=E`:

- `M`: SGLang's model name (`--served-model-name`, else the model path; with the host pool's own
  page format tag when it has one);
- `D`: the stored element type (`bfloat16`, `float16`, ...); fp8 KV is stored as `uint8` and gets
  SGLang's `--kv-cache-dtype` after a colon (`uint8:fp8_e4m3`);
- `L`: the host layout (`--hicache-mem-layout`: `layer_first`, `page_first`, `page_first_direct`,
  `page_head`), which orders a page's bytes;
- `T:B:S`: tokens per page, page bytes, and the host pool's class with one page's shape;
- `R`: the rank's share, comma-separated: `tp{rank}/{size}` (left out for MLA-style KV, which is
  the same on every TP rank: rank 0 writes it, all read it; under DP attention these are the
  attention-TP rank and size, so DP replicas share), `pp{rank}/{size}`, and `cp{rank}/{size}` /
  `dcp{rank}/{size}/page{tokens}` with context parallelism;
- `E`: the key epoch: `key_epoch` from the extra config (empty by default); `clear()` moves it to
  `key_epoch/<16 random hex digits>` for the rest of the process.

The node layout must have the host pool's page bytes and dtype; tenant scoping applies on top.

### vLLM connector keys

The vLLM connector (`clients/vllm_connector.py`) keys pages by the token chain above, with a salt
of its own: vLLM's pages hold more than the tokens decide. With `D = b"kvcache/vllm/v1\\x00"` and
`P(a, b, ...)` the parts each as `u32le(len(x)) + x` (UTF-8 for text):

- **engine salt** = `xxh3_128(D + P(b"engine", salt, model, *formats, epoch))`: `salt` is the
  connector's `salt` (empty by default); `model` the model's fingerprint (hex of its config and
  weight files: names, sizes, sampled bytes; or the connector's `model_fingerprint`), a draft
  model's after a `+`; `formats` the page formats of the engine's ranks, sorted and without
  repeats (`vllm{major.minor}|{device}|{attention backend}|{dtype}|{kv_cache_dtype}|{block shape}`,
  e.g. `vllm0.32|cpu|CPU_ATTN|bfloat16|auto|2x32x64`); `epoch` empty until `reset_cache` makes
  it 8 random bytes.
- **request salt**: the engine salt, or for a request with vLLM's `cache_salt` or a LoRA adapter
  `xxh3_128(D + P(b"request", engine salt, b"cache_salt", cache_salt, b"lora", name, adapter))`
  (each pair only when present; `adapter`: the fingerprint of the adapter's files). Requests with
  prompt embeddings have no keys.
- **keys**: the chain from `root_key(namespace, request salt)`; a page that holds part of a
  multimodal item chains from `xxh3_128(D + P(b"mm", parent, "identifier@offset", ...))` instead
  of its parent (`offset`: the item's first token from the page's first, negative when it starts
  in an earlier page), so every later page differs too.
- **ranks**: in an engine of several ranks, rank `tp{t}/{T}|pp{p}/{P}` stores its share under
  `xxh3_128(b"kvcache/vllm/rank/" + tag + b"\\x00" + key)`.

The connector tells a caller that asks (`kv_transfer_params: {"kvcache_keys": true}` on a
completion) the `namespace`, the request's `salt`, the `engine` salt (hex) and the rank tags
(`ranks`); the router uses them for the decode node's pull and the conductor's `Schedule`.
"""


def render() -> str:
    out = [
        "# gRPC API reference",
        "",
        "Generated from `proto/*.proto` by `python -m proto.docs` (`make proto`); do not edit.",
        "All services are in package `kvcache.v1`, serve gRPC health checking and reflection,",
        "and accept `authorization: Bearer <token>` metadata when started with `--token`.",
        "",
    ]
    sources = []
    for path in proto_files():
        text = path.read_text()
        sources.append((path.name, text))
        for name, rpcs in _services(text):
            out += [
                f"## {name} (`{path.name}`)",
                "",
                "| RPC | request | reply | what it does |",
                "|---|---|---|---|",
            ]
            out += [f"| `{r}` | `{q}` | `{p}` | {c} |" for r, q, p, c in rpcs]
            out.append("")
    out += KEYS.splitlines() + [""]
    out += ["## Messages", ""]
    for name, text in sources:
        out += [f"### `{name}`", "", "```proto", text.rstrip(), "```", ""]
    return "\n".join(out)


def main() -> int:
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
