#!/usr/bin/env python3
"""Test vectors for colibri's `torch_topk` (engine/src/model/torch_topk.rs): rows full of ties
(values drawn from a few levels, -inf tails like a causal mask), with the indices torch.topk
returns for them on the CPU, in torch's order.

    /work/oracle-venv/bin/python engine/tests/oracle/torch_topk_vectors.py \
        > engine/tests/fixtures/torch_topk.json
"""
import json
import torch

g = torch.Generator().manual_seed(0)
cases = []
for n in list(range(1, 34)) + [47, 64, 65, 100, 128, 129, 192, 193, 300]:
    for k in sorted({1, 2, 3, 5, 8, 12, n // 3, n // 2, n - 1, n}):
        if k < 1 or k > n:
            continue
        for levels in (2, 4):
            vals = (torch.randint(0, levels, (n,), generator=g) - 1).tolist()
            vals = torch.tensor(vals, dtype=torch.float32)
            # A masked tail (as the causal mask makes it) on half the cases.
            if torch.randint(0, 2, (1,), generator=g).item() == 1 and n > 2:
                cut = int(torch.randint(1, n, (1,), generator=g).item())
                vals[cut:] = float("-inf")
            idx = vals.topk(k).indices.tolist()
            cases.append({"values": [int(v) if v != float("-inf") else "-inf" for v in vals.tolist()],
                          "k": k, "indices": idx})
print(json.dumps({"torch_version": torch.__version__.split("+")[0], "cases": cases}))
