"""Real engines for the vLLM benches and tests: random-weight models made locally (``models``)
and one vLLM engine run in a process of its own (``vllm_engine``)."""
