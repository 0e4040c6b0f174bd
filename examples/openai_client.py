"""Talk to `kvcache router` with the OpenAI Python client (`make serve-demo` runs this).

    python examples/openai_client.py [http://127.0.0.1:8000/v1]

Two requests share a long prefix: the second goes to the prefill node that holds it, whose engine
computes only the new suffix; each answer's x-kvcache-* headers say where it ran and what moved.
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
        f"{question!r}: prefill on {h['x-kvcache-prefill-node']} "
        f"({h['x-kvcache-prefill-cached-tokens']} of {out.usage.prompt_tokens} prompt tokens "
        f"cached), decode on {h['x-kvcache-decode-node']} "
        f"({out.usage.prompt_tokens_details.cached_tokens} loaded from kvcache; pages pulled "
        f"to it: {h['x-kvcache-pulled-pages']}), text {out.choices[0].text!r}"
    )

print("streamed:", end=" ", flush=True)
for chunk in client.completions.create(
    model=model, prompt=shared + "Stream it.", max_tokens=12, temperature=0, stream=True
):
    print(chunk.choices[0].text, end="", flush=True)
print()
