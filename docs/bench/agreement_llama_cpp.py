#!/usr/bin/env python3
"""Teacher-forced agreement of colibri with llama.cpp on one GGUF file (issue 18, item 6).

For each prompt: llama.cpp tokenizes it and extends it greedily to `--positions` tokens; then the
same token sequence is teacher-forced through both engines and the next-token distributions are
compared position by position: KL(llama.cpp ‖ colibri), and whether both put the same token on top.
Positions where llama.cpp's own top-2 probabilities are within `--margin` of each other are
reported apart (near-ties, where llama.cpp with flash attention on and off already disagree; that
disagreement is measured too, as the baseline).

    python docs/bench/agreement_llama_cpp.py --coli target/release/coli \
        --model /work/bench/SmolLM2-135M-Instruct.Q4_1.gguf --prompts docs/bench/kl-prompts.txt \
        --threads 2 [--json OUT]

Needs `llama-cpp-python` and numpy in the interpreter that runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
from llama_cpp import Llama


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def llama_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def coli_logits(coli: str, model: str, ids: list[int], threads: int) -> np.ndarray:
    out = subprocess.run(
        [coli, "logits", "-m", model, "--threads", str(threads), "--device", "cpu",
         "--tokens", ",".join(map(str, ids))],
        check=True, capture_output=True, text=True,
    ).stdout
    return np.array(json.loads(out)["logits"], dtype=np.float32)


def compare(ref: np.ndarray, other: np.ndarray, margin: float) -> dict:
    lp, lq = log_softmax(ref), log_softmax(other)
    p = np.exp(lp)
    kl = (p * (lp - lq)).sum(axis=-1)
    top2 = np.sort(p, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= margin
    same = ref.argmax(axis=-1) == other.argmax(axis=-1)
    return {"kl": kl, "same": same, "clear": clear}


def summary(parts: list[dict]) -> dict:
    kl = np.concatenate([c["kl"] for c in parts])
    same = np.concatenate([c["same"] for c in parts])
    clear = np.concatenate([c["clear"] for c in parts])
    return {
        "positions": int(len(kl)),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_all": float(same.mean()),
        "clear_positions": int(clear.sum()),
        "top1_clear": float(same[clear].mean()) if clear.any() else None,
        "near_tie_positions": int((~clear).sum()),
        "top1_near_tie": float(same[~clear].mean()) if (~clear).any() else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coli", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-prompts", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()

    prompts = [l.strip() for l in open(a.prompts, encoding="utf-8") if l.strip()][: a.max_prompts]
    ctx = a.positions + 8
    fa_off = Llama(a.model, n_ctx=ctx, n_threads=a.threads, logits_all=True, flash_attn=False, verbose=False)
    fa_on = Llama(a.model, n_ctx=ctx, n_threads=a.threads, logits_all=True, flash_attn=True, verbose=False)
    vs_coli, vs_fa = [], []
    for i, text in enumerate(prompts):
        ids = fa_off.tokenize(text.replace("\\n", "\n").encode(), add_bos=True, special=False)[: a.positions]
        # Extend greedily with llama.cpp to the number of positions compared.
        fa_off.reset()
        fa_off.eval(ids)
        while len(ids) < a.positions:
            ids.append(int(np.argmax(fa_off.scores[len(ids) - 1])))
            fa_off.eval(ids[-1:])
        ref = llama_logits(fa_off, ids)
        c = compare(ref, coli_logits(a.coli, a.model, ids, a.threads), a.margin)
        f = compare(ref, llama_logits(fa_on, ids), a.margin)
        vs_coli.append(c)
        vs_fa.append(f)
        print(f"prompt {i}: {len(ids)} positions, mean KL {c['kl'].mean():.2e}, "
              f"top-1 {c['same'].mean():.3f} (clear {c['same'][c['clear']].mean():.3f}); "
              f"llama.cpp FA on vs off: KL {f['kl'].mean():.2e}, top-1 {f['same'].mean():.3f}",
              file=sys.stderr)
    result = {
        "model": a.model,
        "threads": a.threads,
        "margin": a.margin,
        "prompts": len(prompts),
        "colibri_vs_llama_cpp": summary(vs_coli),
        "llama_cpp_flash_attn_on_vs_off": summary(vs_fa),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
