"""llama.cpp's speed on a GGUF file, measured like `coli bench`: prefill N synthetic tokens
in one batch from an empty cache, then decode M tokens one at a time (llama-bench's pp/tg).
Prints one JSON object. Needs llama-cpp-python.

    python llama_cpp_speed.py MODEL.gguf --threads 2 --prompt-tokens 512 --gen-tokens 64
"""
import argparse
import json
import time

from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention on")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no 8-token warm-up eval before the measured prefill, so the prefill is the "
                         "first touch of the weights (larger-than-RAM runs: ttft_s = load + prefill)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    llm = Llama(model_path=a.model, n_ctx=a.prompt_tokens + a.gen_tokens + 8,
                n_batch=a.prompt_tokens, n_ubatch=a.prompt_tokens, n_threads=a.threads,
                n_threads_batch=a.threads, flash_attn=a.flash_attn, verbose=False)
    load = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    prompt = [(i * 7919 + 13) % (n_vocab - 10) + 5 for i in range(a.prompt_tokens)]
    if not a.no_warmup:
        llm.eval(prompt[:8])  # warm-up
        llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = 5
    for _ in range(a.gen_tokens):
        llm.eval([tok])
        tok = (tok * 31 + 7) % (n_vocab - 10) + 5
    tg = time.perf_counter() - t0
    print(json.dumps({"engine": "llama.cpp", "threads": a.threads, "flash_attn": a.flash_attn,
                      "load_s": load,
                      "warmup": not a.no_warmup,
                      "ttft_s": load + pp,
                      "prefill_tok_per_s": a.prompt_tokens / pp,
                      "decode_tok_per_s": a.gen_tokens / tg,
                      "loadavg": open("/proc/loadavg").read().split()[:3]}))


if __name__ == "__main__":
    main()
