"""Schemathesis hooks for test_observability.py.

Generated request bodies name the served model (else every one ends in 404), keep token counts
within the server's --max-tokens-cap, and an empty `messages` list or `prompt` gets one entry,
so that more of them get past validation and reach the engine. Everything else stays as
generated. (The schema does not say that these fields must be non-empty or within the cap.)
"""

import os

import schemathesis

MODEL = os.environ["COLI_TEST_MODEL_ID"]
CAP = int(os.environ["COLI_TEST_MAX_TOKENS_CAP"])


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body:
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = min(max(value, 1), CAP)
    if body.get("messages") == []:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    if body.get("prompt") in ("", [], [""]):
        body["prompt"] = "Hi"
    return body
