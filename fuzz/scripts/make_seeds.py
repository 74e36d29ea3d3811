#!/usr/bin/env python3
"""Write the committed seed corpus under fuzz/corpus/<target>/: small valid and near-valid
inputs, taken from the repository's fixtures or built here by the formats' own rules (KV
files and GGUF by their documented layouts). Run from anywhere; rerunning rewrites the same
files. `fuzz/corpus/gguf/llama-q8_0.gguf` is written by `coli convert` (see fuzz/README.md)."""

import hashlib
import json
import os
import struct
import sys

FUZZ = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(FUZZ)
FIXTURES = os.path.join(ROOT, "engine", "tests", "fixtures")


def put(target, name, data):
    d = os.path.join(FUZZ, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- safetensors ---------------------------------------------------------------------------
def safetensors(tensors, metadata=None):
    header, blob = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


two = {
    "model.embed_tokens.weight": ("F32", [2, 3], struct.pack("<6f", *range(6))),
    "model.norm.weight": ("BF16", [3], b"\x80\x3f" * 3),
}
st = safetensors(two, {"format": "pt"})
put("safetensors", "two-tensors.safetensors", st)
put("safetensors", "truncated.safetensors", st[:-5])
put("safetensors", "empty-shape.safetensors", safetensors({"x": ("F16", [0, 4], b""), "s": ("I64", [], b"\0" * 8)}))
put("safetensors", "fp8.safetensors", safetensors({"w": ("F8_E4M3", [2, 2], b"\1\2\3\4"), "w_scale_inv": ("F8_E8M0", [1], b"\x7f"), "u": ("U8", [3], b"abc")}))
index = json.dumps({"metadata": {"total_size": len(st)}, "weight_map": {
    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
    "model.norm.weight": "model-00002-of-00002.safetensors"}}).encode()
put("safetensors", "index-two-shards", index + b"\0" + st)
put("safetensors", "index-bad-name", json.dumps({"weight_map": {"a": "../x.safetensors"}}).encode() + b"\0" + st)

# --- gguf ----------------------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64 = 4, 5, 6, 7, 8, 9, 10


def kv(key, t, v):
    out = gstr(key) + struct.pack("<I", t)
    if t == T_U32:
        out += struct.pack("<I", v)
    elif t == T_I32:
        out += struct.pack("<i", v)
    elif t == T_F32:
        out += struct.pack("<f", v)
    elif t == T_BOOL:
        out += bytes([v])
    elif t == T_STR:
        out += gstr(v)
    elif t == T_ARR:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for i in items:
            out += gstr(i) if et == T_STR else struct.pack("<i" if et == T_I32 else "<f", i)
    return out


def gguf(metadata, tensors, version=3, alignment=32):
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for m in metadata:
        out += m
    offset, blobs = 0, []
    for name, dims, ggml_type, data in tensors:
        offset += -offset % alignment
        out += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
        blobs.append((offset, data))
        offset += len(data)
    out += b"\0" * (-len(out) % alignment)
    base = len(out)
    for off, data in blobs:
        out += b"\0" * (base + off - len(out)) + data
    return out


vocab = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġa", "<|im_start|>"]
meta = [
    kv("general.architecture", T_STR, "llama"),
    kv("general.alignment", T_U32, 32),
    kv("llama.block_count", T_U32, 1),
    kv("llama.embedding_length", T_U32, 4),
    kv("llama.feed_forward_length", T_U32, 8),
    kv("llama.attention.head_count", T_U32, 2),
    kv("llama.attention.head_count_kv", T_U32, 1),
    kv("llama.context_length", T_U32, 64),
    kv("llama.rope.freq_base", T_F32, 10000.0),
    kv("llama.attention.layer_norm_rms_epsilon", T_F32, 1e-6),
    kv("tokenizer.ggml.model", T_STR, "gpt2"),
    kv("tokenizer.ggml.pre", T_STR, "default"),
    kv("tokenizer.ggml.tokens", T_ARR, (T_STR, vocab)),
    kv("tokenizer.ggml.token_type", T_ARR, (T_I32, [3, 3, 1, 1, 1, 1, 1, 4])),
    kv("tokenizer.ggml.merges", T_ARR, (T_STR, ["a b", "Ġ a"])),
    kv("tokenizer.ggml.bos_token_id", T_U32, 0),
    kv("tokenizer.ggml.eos_token_id", T_U32, 1),
    kv("tokenizer.ggml.add_bos_token", T_BOOL, 1),
]
f32 = lambda n: struct.pack(f"<{n}f", *([0.5] * n))
tensors = [
    ("token_embd.weight", [4, 8], 0, f32(32)),
    ("output_norm.weight", [4], 0, f32(4)),
    ("blk.0.attn_q.weight", [4, 4], 1, b"\0\x3c" * 16),
    ("blk.0.attn_k.weight", [32, 2], 8, (b"\0\x3c" + b"\1" * 32) * 2),
]
g = gguf(meta, tensors)
put("gguf", "tiny-llama.gguf", g)
put("gguf", "tiny-llama-v2.gguf", gguf(meta, tensors, version=2))
put("gguf", "truncated.gguf", g[: len(g) - 7])
put("gguf", "metadata-only.gguf", gguf(meta[:2] + [kv("tokenizer.ggml.model", T_STR, "llama"),
                                                  kv("tokenizer.ggml.tokens", T_ARR, (T_STR, vocab)),
                                                  kv("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * len(vocab)))], []))

# --- config.json: every fixture's ------------------------------------------------------------
for root, dirs, files in sorted(os.walk(FIXTURES)):
    if "config.json" in files:
        rel = os.path.relpath(root, FIXTURES).replace(os.sep, "-")
        with open(os.path.join(root, "config.json"), "rb") as f:
            put("config", f"{rel}.json", f.read())
put("config", "unknown-type.json", '{"model_type": "gpt5", "num_hidden_layers": 2}')
put("config", "huge-layers.json", '{"model_type": "llama", "num_hidden_layers": 1000000000000, "hidden_size": 64}')

# --- tokenizer.json --------------------------------------------------------------------------
with open(os.path.join(FIXTURES, "llama", "tokenizer.json"), "rb") as f:
    put("tokenizer", "fixture-bpe.json", f.read())
put("tokenizer", "wordlevel.json", json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}, "pre_tokenizer": {"type": "Whitespace"}}))
put("tokenizer", "bytefallback.json", json.dumps({"version": "1.0", "added_tokens": [{"id": 0, "content": "<unk>", "special": True, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "byte_fallback": True, "unk_token": "<unk>", "vocab": {"<unk>": 0, "<0x41>": 1, "▁": 2, "a": 3, "▁a": 4}, "merges": ["▁ a"]}}))
put("tokenizer", "unigram.json", json.dumps({"version": "1.0", "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["a", -1.0], ["b", -2.0]]}}))

# --- chat templates: a template index byte, then the JSON --------------------------------------
weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "21 C."}]
for i in range(8):
    put("chat_template", f"conversation-{i}", bytes([i]) + json.dumps({"messages": conv, "tools": [weather], "extra": {"enable_thinking": i % 2 == 0}}).encode())
put("chat_template", "bare-array", b"\x01" + json.dumps([{"role": "user", "content": "hi"}]).encode())
put("chat_template", "hostile", b"\x02" + json.dumps({"messages": [{"role": 5, "content": {"a": [1]}}, {"role": "assistant", "tool_calls": "x"}], "tools": [{"function": None}], "extra": {"messages": 1}}).encode())

# --- grammar: a kind byte (0 strict schema, 1 schema, 2 lark, 3 regex, 4 any object), the text --
schemas = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}, "required": ["name"]},
    {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 3},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 3}]},
    {"anyOf": [{"type": "number"}, {"type": "null"}, {"type": "boolean"}]},
]
for i, s in enumerate(schemas):
    put("grammar", f"schema-{i}", bytes([i % 2]) + json.dumps(s).encode())
put("grammar", "lark", b"\x02" + b'start: "yes" | "no" | num\nnum: /[0-9]+/\n')
put("grammar", "lark-json", b'\x02start: %json {"type": "object"}\n')
put("grammar", "regex", b"\x03(foo|bar)[0-9]{1,3}")
put("grammar", "regex-empty", b"\x03[]")
put("grammar", "object", b"\x04")

# --- request bodies ----------------------------------------------------------------------------
bodies = [
    {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "seed": 3},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}], "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "weather?"}], "tools": [weather], "tool_choice": "required", "parallel_tool_calls": False},
    {"messages": [{"role": "user", "content": "x"}], "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": [conv[1], conv[2], conv[3]], "tools": [weather]},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schemas[0], "strict": True}}},
    {"messages": [{"role": "user", "content": "x"}], "grammar": "start: \"a\"", "chat_template_kwargs": {"enable_thinking": False}, "stop": "end", "n": 1, "ignore_eos": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"prompt": "Once upon", "max_tokens": 4, "echo": True, "logprobs": 1},
    {"prompt": [1, 2, 3]},
    {"prompt": ["one"], "response_format": {"type": "json_object"}},
]
for i, b in enumerate(bodies):
    put("request", f"body-{i}.json", json.dumps(b))
put("request", "trailing.json", '{"messages": []} x')
put("request", "bad-type.json", '{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}')

# --- tool calls: mode byte (format in the low 4 bits), cuts, NUL, prompt NUL text ----------------
texts = [
    (0, '<think>Let me see.</think>I will call it.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'),
    (1, '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>'),
    (2, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    (3, 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    (4, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
    (5, '<think>ok</think><｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
    (6, '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
    (7, '<|open|>call tool="get_weather"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|><|close|>'),
    (8, '<think>hmm</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>'),
    (9, '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>'),
    (10, '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'),
    (10, '<|channel|>final<|message|>It is 21 C.<|return|>'),
    (11, '<|content_thinking|>plan<|content_end|><|content_invoke_tool_json|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|content_end|>'),
    (0, 'no tags at all, only <thi'),
    (0x10, '<think>kept</think> as content'),
    (0x20, '<think>reason</think>answer <tool_call>{"name": "x"}</tool_call>'),
]
for i, (mode, text) in enumerate(texts):
    put("tool_calls", f"text-{i}", bytes([mode, 1, 3, 2, 7, 0]) + b"\0" + text.encode())
put("tool_calls", "prompt-opens-thought", bytes([0, 2, 0]) + "<|im_start|>assistant\n<think>\n\0still thinking</think>done".encode())

# --- KV files: mode byte (0: version 2, 1: version 1), then the body ------------------------------
def kv_body(version, fingerprint=b"fuzz-model", layers=2, tokens=(1, 2, 3), cache_len=2, max_len=8, width=32, state=0):
    b = struct.pack("<I", len(fingerprint)) + fingerprint + struct.pack("<I", layers)
    b += struct.pack("<QQQ", len(tokens), cache_len, max_len)
    b += b"".join(struct.pack("<I", t) for t in tokens)
    held = (cache_len * width, cache_len * width, 0) + ((state,) if version == 2 else ())
    for _ in range(layers):
        b += b"".join(struct.pack("<Q", h) for h in held)
    for _ in range(layers):
        for h in held:
            b += struct.pack(f"<{h}f", *([0.25] * h))
    return b

put("kv_file", "llama-v2", b"\0" + kv_body(2))
put("kv_file", "llama-v1", b"\1" + kv_body(1))
put("kv_file", "other-model", b"\0" + kv_body(2, fingerprint=b"another"))
put("kv_file", "empty-cache", b"\0" + kv_body(2, tokens=(5,), cache_len=0))
put("kv_file", "state", b"\0" + kv_body(2, layers=1, width=4, state=6))
put("kv_file", "raw-bad-magic", b"\xffCOLI_KV\1" + b"\0" * 40)

# --- usage histories ---------------------------------------------------------------------------
hist = {"version": 1, "fingerprint": "fuzz-model", "tokens": 100, "since_save": 10, "updated": 1700000000,
        "layers": [[], [1.0, 2.5, 0.0, 4.0], [0.0] * 7 + [9.0]]}
put("history", "valid.json", json.dumps(hist))
put("history", "no-updated.json", json.dumps({k: v for k, v in hist.items() if k != "updated"}))
put("history", "wrong-shape.json", json.dumps(dict(hist, layers=[[1.0]])))
put("history", "negative.json", json.dumps(dict(hist, layers=[[], [-1.0, 0, 0, 0], [0] * 8])))
put("history", "other-fingerprint.json", json.dumps(dict(hist, fingerprint="x")))
put("history", "version-2.json", json.dumps(dict(hist, version=2)))
print("seeds written under", os.path.join(FUZZ, "corpus"))
