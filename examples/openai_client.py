"""Talk to `kvcache router` with the OpenAI Python client (`make serve-demo` runs this).

    python examples/openai_client.py [http://127.0.0.1:8000/v1]

Two completions share a long prefix: the second goes to the node that holds it, whose engine
computes only the new suffix; each answer's x-kvcache-* headers say where it ran and what moved,
its usage how many prompt tokens were served from a cache. Then a two-turn chat: the second turn
goes where the first one's prompt is cached.
"""

import sys

from openai import OpenAI

client = OpenAI(
    base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1", api_key="unused"
)
model = client.models.list().data[0].id
shared = "Mooncake splits prefill and decode across nodes and moves the KV cache between them. " * 4

for question in ("What moves?", "Who decodes?"):
    raw = client.completions.with_raw_response.create(
        model=model, prompt=shared + question, max_tokens=12, temperature=0
    )
    out, h = raw.parse(), raw.headers
    print(
        f"{question!r}: {h['x-kvcache-mode']}, prefill on {h['x-kvcache-prefill-node']} "
        f"({out.usage.prompt_tokens_details.cached_tokens} of {out.usage.prompt_tokens} prompt "
        f"tokens cached), decode on {h['x-kvcache-decode-node']} (pages pulled to it: "
        f"{h['x-kvcache-pulled-pages']}), text {out.choices[0].text!r}"
    )

print("streamed:", end=" ", flush=True)
for chunk in client.completions.create(
    model=model, prompt=shared + "Stream it.", max_tokens=12, temperature=0, stream=True
):
    print(chunk.choices[0].text, end="", flush=True)
print()

messages = [
    {"role": "system", "content": "You are a terse assistant who knows KV caches. " * 3},
    {"role": "user", "content": "Where does my prompt's KV cache go between two turns?"},
]
for turn in (1, 2):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    out, h = raw.parse(), raw.headers
    usage = out.usage
    print(
        f"chat turn {turn}: {usage.prompt_tokens_details.cached_tokens} of "
        f"{usage.prompt_tokens} prompt tokens cached, served on {h['x-kvcache-decode-node']}"
    )
    messages += [
        {"role": "assistant", "content": out.choices[0].message.content or ""},
        {"role": "user", "content": "And on the next turn?"},
    ]
