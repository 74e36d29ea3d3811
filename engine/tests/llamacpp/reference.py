"""Greedy continuations from llama.cpp (through llama-cpp-python) for the llama.cpp
comparison tests: `python reference.py MODEL.gguf OUT.json [--tokens 32]`.

For each prompt it records llama.cpp's own tokenization (add_bos as the file says, special
tokens parsed) and the argmax continuation, with the top-1/top-2 logit margin at every step
(a step with a tiny margin can flip on any rounding difference; the test reports it).
The prompts are fixed here; the output is committed as a fixture.
"""
import argparse
import json

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of the forest,",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", help="JSON list of prompts instead of the built-in ones")
    ap.add_argument("--ids", help="comma-separated prompt token ids instead of text prompts")
    args = ap.parse_args()
    prompts = json.load(open(args.prompts)) if args.prompts else PROMPTS
    llm = Llama(model_path=args.model, n_ctx=512, n_batch=512, n_threads=args.threads,
                logits_all=True, verbose=False)
    cases = []
    if args.ids:
        prompts = [None]
    for text in prompts:
        if args.ids:
            ids = [int(i) for i in args.ids.split(",")]
        else:
            ids = llm.tokenize(text.encode(), add_bos=llm._model.add_bos_token(), special=True)
        llm.reset()
        llm.eval(ids)
        out, margins = [], []
        for _ in range(args.tokens):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            top2 = np.argsort(logits)[-2:]
            tok = int(np.argmax(logits))
            margins.append(float(logits[top2[1]] - logits[top2[0]]))
            out.append(tok)
            llm.eval([tok])
        cases.append({"prompt": text, "prompt_ids": [int(i) for i in ids],
                      "greedy_ids": out, "margins": margins,
                      "text": llm.detokenize(out).decode("utf-8", "replace") if text else None})
    json.dump({"model": args.model.split("/")[-1], "engine": "llama.cpp via llama-cpp-python",
               "cases": cases}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
