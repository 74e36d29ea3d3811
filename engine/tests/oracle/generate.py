#!/usr/bin/env python3
"""Oracle fixture generator for colibri.

Builds tiny, randomly initialised Hugging Face models (CPU, float32, eager attention, eager experts) for
each supported architecture, randomises every parameter that would otherwise be initialised to a constant
(norm weights, biases, router correction biases, sinks, ...), and writes a real HF model directory per
architecture:

    <out>/<arch>/config.json              as written by save_pretrained
    <out>/<arch>/model.safetensors        as written by save_pretrained (float32; kimi_k25: blocks->layers)
    <out>/<arch>/generation_config.json
    <out>/<arch>/tokenizer.json           byte-level BPE trained on the built-in corpus, |vocab| == vocab_size
    <out>/<arch>/tokenizer_config.json    ChatML chat_template, special tokens
    <out>/<arch>/reference.json           prompt ids, full-prompt logits, 16 greedy ids, router choices

Usage:
    python generate.py --all
    python generate.py --arch olmoe --seed 7 --prompt-len 40 --set num_key_value_heads=2 --out /tmp/fx

--set KEY=VALUE overrides a field of the (text) config before the model is built. VALUE is parsed as JSON
when possible (ints, floats, true/false/null, lists, dicts; Python True/False/None are accepted too), else
kept as a string. Dotted keys set nested dict entries (e.g. rope_parameters.factor=4). For composite
(vision-language) models the keys address the text config; prefix with "top." for the top-level config or
"vision_config." for the vision config. When num_hidden_layers is overridden, the per-layer schedules
(layer_types, mlp_layer_types, ...) are regenerated from the architecture's pattern unless they are
overridden too.

See engine/tests/fixtures/README.md for the list of fixtures and what each exercises.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

EXPECTED_TRANSFORMERS = "5.23.0"
DEFAULT_VOCAB = 384
DEFAULT_PROMPT_LEN = 34
GREEDY_NEW_TOKENS = 16
# A greedy step whose top-1/top-2 logit gap is below this is a potential flake for an engine that matches
# the oracle to ~1e-5; the prompt is changed (deterministically) until every step clears it, if possible.
MIN_GREEDY_MARGIN = 1e-3
# Same idea for every discrete top-k selection inside the model (routers, expert groups, sparse-attention
# indexers), measured in the selection-score space (probabilities / sigmoid scores / indexer scores).
MIN_TOPK_MARGIN = 1e-4
MAX_PROMPT_ATTEMPTS = 40

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Fixed training corpus for the tokenizer (plain ASCII, written for this generator).
CORPUS = """\
The river town woke slowly in the early light. Fishermen pulled their boats onto the gravel bank, and the \
smell of bread drifted from the bakery on the corner. Children ran along the narrow streets with their dogs, \
shouting to each other about the market that would open at noon. An old man sat on a bench near the bridge, \
reading a newspaper that was already three days old, and nodding to everyone who passed.

In the workshop behind the station, a young engineer named Clara was repairing a clock that had stopped \
working many years ago. She opened the back panel, cleaned every gear with a soft brush, and replaced a \
spring that had rusted through. When she wound the key, the clock began to tick again, and the sound filled \
the quiet room like a heartbeat. She smiled, wrote a short note in her book, and set the clock on the shelf.

Computers read text as numbers. A tokenizer splits a sentence into small pieces, and each piece is given an \
integer id. A language model then reads those ids one at a time and predicts which piece should come next. \
The model has many layers, and each layer mixes information between positions with attention and then \
transforms every position with a small network. Some models send each token to only a few experts, which \
saves computation while keeping a large number of parameters.

The mountain path was steep and covered with loose stones. Two friends climbed it together in the afternoon, \
stopping often to drink water and to look back at the valley below. The fields were green and yellow, the \
roads were thin grey lines, and the lake shone like a mirror under the sun. At the top they found a small \
wooden hut where travelers could rest, and they stayed there until the stars came out over the hills.

Good software is tested carefully. Every function should do one thing well, and every test should check one \
behavior at a time. When a result is wrong, the first step is to make the failure small and repeatable. \
Then the engineer reads the code line by line, compares the numbers with a trusted reference, and fixes the \
first place where they differ. Patience is more useful than speed when the problem is hard.

The library opened at nine in the morning and closed at six in the evening. Students came to study for their \
exams, writers came to find quiet corners, and families came on the weekend to borrow picture books for their \
children. The librarian knew most of the visitors by name. She kept a list of new books on the desk, and she \
always had a recommendation for anyone who asked what to read next.

Weather changes quickly near the sea. A bright morning can turn into a windy afternoon, and a calm evening \
can bring heavy rain before midnight. Sailors watch the clouds, the birds, and the color of the water to \
guess what will happen. They say that a red sky at night is a good sign, while a red sky in the morning is a \
warning to stay in the harbor and wait for better days.
"""

# Sentences the prompts are cut from (distinct from the corpus, same plain vocabulary).
PROMPT_SENTENCES = [
    "The old clock in the station began to tick again after many years of silence.",
    "A small boat drifted slowly across the lake while the children watched from the bank.",
    "Every morning the baker opened the shop and the smell of bread filled the street.",
    "The engineer compared the numbers with the reference and found the first place where they differ.",
    "Two friends climbed the mountain path and rested in a wooden hut at the top.",
    "The librarian kept a list of new books on the desk for anyone who asked.",
    "When the wind changed, the sailors looked at the clouds and returned to the harbor.",
    "A language model reads the ids one at a time and predicts the next piece of text.",
    "The market opened at noon and the square was full of people, dogs and music.",
    "She wrote a short note in her book and set the repaired clock on the shelf.",
    "The river was calm in the evening, and the lights of the town shone on the water.",
    "Good tests check one behavior at a time, so a failure is small and easy to repeat.",
    "The students studied for their exams in the quiet corners of the library.",
    "An old man read the newspaper on a bench near the bridge and nodded to everyone.",
    "The fields were green and yellow, and the roads were thin grey lines in the valley.",
    "Each layer mixes information between positions and then transforms every position.",
]


# ----------------------------------------------------------------------------------------------------------
# Architecture table
# ----------------------------------------------------------------------------------------------------------

# Shared by every text config. initializer_range 0.1 (instead of 0.02) gives O(1) logits and clear argmax
# margins at hidden size 64, so greedy decoding is robust to the ~1e-6 differences of another engine.
COMMON_TEXT = dict(initializer_range=0.1)


def cfg_llama(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )


def cfg_mixtral(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        sliding_window=24, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def cfg_olmoe(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=3.0,
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def cfg_qwen3_moe(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False,
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def cfg_minimax_m2(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    )


def cfg_glm4_moe(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )


def cfg_gpt_oss(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
        rms_norm_eps=1e-5, attention_bias=True, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    )


def _mla(**kw):
    base = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    base.update(kw)
    return base


def cfg_deepseek_v3(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, **_mla(), n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )


def cfg_kimi_k25(V):
    return dict(
        model_type="deepseek_v3",
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, **_mla(), n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
        first_k_dense_replace=1, rope_interleave=True, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                         "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )


def cfg_kimi_linear(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, linear_head_dim=16,
        linear_num_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def cfg_glm_moe_dsa(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, **_mla(), n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_topk=6, index_head_dim=16, index_n_heads=8, index_topk_freq=2, index_skip_topk_offset=2,
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def cfg_qwen3_next(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )


def cfg_qwen3_5_moe(V):
    return dict(
        vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )


def cfg_inkling(V):
    return dict(
        vocab_size=V, unpadded_vocab_size=None, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16, log_scaling_n_floor=4,
        log_scaling_alpha=0.1, conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, route_scale=8.0,
        logits_mup_width_multiplier=2.0, rms_norm_eps=1e-6, max_position_embeddings=256,
        dense_mlp_idx=1,
    )


def cfg_inkling2(V):
    return dict(
        vocab_size=V, unpadded_vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16, log_scaling_n_floor=4,
        log_scaling_alpha=0.1, conv_kernel_size=4, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, route_scale=8.0, n_layers_per_attn_res_block=2, mlp_gate_softcap=4.0,
        mlp_up_softcap=25.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=256,
    )


def cfg_glm5_next(V):
    return dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, swiglu_limit=10.0,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=2, hc_eps=1e-6, hc_sinkhorn_iters=5, index_kpool=4, index_kpool_always_select_tail=True,
        index_topk=8, index_head_dim=16, index_n_heads=8, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def cfg_deepseek_v4(V):
    return dict(
        vocab_size=V, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2,
        n_routed_experts=8, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, rope_theta=10000.0, compress_rope_theta=160000.0,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=2, hc_sinkhorn_iters=5, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=6, o_groups=2,
        o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=2, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    )


# Per-layer schedules regenerated from num_hidden_layers (n) unless overridden explicitly.
PER_LAYER = {
    "kimi_linear": {
        "layer_types": lambda n: ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        "mlp_layer_types": lambda n: ["dense" if i < 1 else "sparse" for i in range(n)],
    },
    "qwen3_next": {
        "layer_types": lambda n: ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
    },
    "qwen3_5_moe": {
        "layer_types": lambda n: ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
    },
    "gpt_oss": {
        "layer_types": lambda n: ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    },
    "inkling": {
        "layer_types": lambda n: ["hybrid" if i % 2 == 1 else "hybrid_sliding" for i in range(n)],
    },
    "inkling2": {
        "layer_types": lambda n: ["hybrid" if i % 4 == 2 else "hybrid_sliding" for i in range(n)],
    },
    "glm5_next": {
        # KDA, indexed(full), indexed(shared), KDA, ...: the shared indexer layer directly follows a full one.
        "layer_types": lambda n: ["indexed_attention" if i % 4 in (1, 2) else "linear_attention"
                                  for i in range(n)],
        "indexer_types": lambda n: ["shared" if i % 4 == 2 else "full" for i in range(n)],
        "mlp_layer_types": lambda n: ["dense" if i < 1 else "sparse" for i in range(n)],
    },
    "deepseek_v4": {
        "layer_types": lambda n: [["heavily_compressed_attention", "compressed_sparse_attention",
                                   "sliding_attention", "compressed_sparse_attention"][i % 4] for i in range(n)],
        "mlp_layer_types": lambda n: ["hash_moe" if i < 2 else "moe" for i in range(n)],
    },
}


# The variant grid (`--variants`, written to <out>/variants/<name>): other seeds, shapes and schedules of
# the sparse-attention families, chosen to reach what the base fixtures do not: indexers that have to
# drop keys for many positions, odd indexer head counts (exact ReLU ties, `allow_ties`), the
# index_topk_freq / index_skip_topk_offset schedule, a full indexer layer after a shared one, expert
# groups, and for DeepSeek-V4 more streams and Sinkhorn iterations, other windows, rates and layer
# orders, an indexer top-k far below the number of compressed entries, and a binding SwiGLU clamp; for the
# hybrid linear-attention families (qwen3_next, qwen3_5_moe, kimi_linear, glm5_next) other linear-attention
# head layouts, conv kernels and layer schedules (see the comments above each group).
# (name, arch, seed, prompt_len, --set overrides, allow_ties)
VARIANTS = [
    ("dsa_heads3_ties", "glm_moe_dsa", 1, 40, ["index_n_heads=3", "index_topk=12", "num_hidden_layers=4"], True),
    ("dsa_freq2_offset2", "glm_moe_dsa", 2, 40, ["num_hidden_layers=5", "index_topk=12", "index_topk_freq=2", "index_skip_topk_offset=2"], False),
    ("dsa_full_after_shared", "glm_moe_dsa", 3, 36, ["num_hidden_layers=4", "index_topk=8", 'indexer_types=["full","shared","full","shared"]'], False),
    ("dsa_topk_group2", "glm_moe_dsa", 4, 40, ["n_group=4", "topk_group=2", "index_topk=10", "index_n_heads=4"], False),
    ("dsa_freq3_offset3", "glm_moe_dsa", 5, 38, ["num_hidden_layers=5", "index_topk=5", "index_topk_freq=3", "index_skip_topk_offset=3", "index_head_dim=12"], False),
    ("dsa_heads3_shared_ties", "glm_moe_dsa", 6, 40, ["index_n_heads=3", "index_topk=12", "num_hidden_layers=5", "n_group=2", "topk_group=1", 'indexer_types=["full","shared","full","full","shared"]'], True),
    # index_topk 1: rows of 64 keys and more take torch's partial_sort path instead of nth_element.
    ("dsa_heads2_topk1_ties", "glm_moe_dsa", 7, 68, ["index_n_heads=2", "index_topk=1"], True),
    ("v4_hc3_sinkhorn6", "deepseek_v4", 1, 40, ["hc_mult=3", "hc_sinkhorn_iters=6"], False),
    ("v4_window8_topk3", "deepseek_v4", 2, 44, ["sliding_window=8", "index_topk=3"], False),
    ("v4_order_s_csa_hca_csa", "deepseek_v4", 3, 40, ['layer_types=["sliding_attention","compressed_sparse_attention","heavily_compressed_attention",' '"compressed_sparse_attention"]', "index_topk=4"], False),
    ("v4_swiglu_binding", "deepseek_v4", 4, 40, ["swiglu_limit=0.5", "index_topk=3"], False),
    ("v4_heads3_ties", "deepseek_v4", 5, 44, ["index_n_heads=3", "index_topk=3"], True),
    ("v4_heads1_rate2_ties", "deepseek_v4", 7, 40, ["index_n_heads=1", "index_topk=2", 'compress_rates={"compressed_sparse_attention":2,"heavily_compressed_attention":8}'], True),
    ("v4_rates2_4", "deepseek_v4", 6, 40, ['compress_rates={"compressed_sparse_attention":2,"heavily_compressed_attention":4}', "index_topk=5", "sliding_window=5"], False),
    # Gated DeltaNet (qwen3_next / qwen3_5_moe): key/value head ratios 1/4, 4/4 and 2/2, key head dim !=
    # value head dim, conv kernels 2 and 3, full attention first / every other layer / twice, other kv heads,
    # head_dim and partial rotary factors (qwen3_5_moe: with an mrope_section that matches), R1 without
    # renorm, and dense layers by decoder_sparse_step / mlp_only_layers.
    ("qnext_k1v4_conv2_fullfirst", "qwen3_next", 11, 38, ["linear_num_key_heads=1", "linear_num_value_heads=4", "linear_conv_kernel_dim=2", 'layer_types=["full_attention","linear_attention","linear_attention","linear_attention"]', "num_key_value_heads=1", "norm_topk_prob=false", "decoder_sparse_step=2"], False),
    ("qnext_k4v4_kd8vd24_conv3_interval2", "qwen3_next", 12, 42, ["linear_num_key_heads=4", "linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=24", "linear_conv_kernel_dim=3", 'layer_types=["linear_attention","full_attention","linear_attention","full_attention"]', "num_key_value_heads=4", "head_dim=24", "rope_parameters.partial_rotary_factor=0.5"], False),
    ("qnext_k2v2_vd32_two_full_dense0", "qwen3_next", 13, 36, ["num_hidden_layers=5", "linear_num_key_heads=2", "linear_num_value_heads=2", "linear_key_head_dim=16", "linear_value_head_dim=32", 'layer_types=["linear_attention","full_attention","linear_attention","linear_attention",' '"full_attention"]', "mlp_only_layers=[0]", "num_experts_per_tok=3", "num_attention_heads=2", "num_key_value_heads=2", "head_dim=32", "rope_parameters.partial_rotary_factor=1.0"], False),
    ("q35_k1v4_conv2_fullfirst", "qwen3_5_moe", 21, 40, ["linear_num_key_heads=1", "linear_num_value_heads=4", "linear_conv_kernel_dim=2", 'layer_types=["full_attention","linear_attention","linear_attention","linear_attention"]', "num_key_value_heads=1"], False),
    ("q35_k4v4_kd8_conv3_interval2_hd32", "qwen3_5_moe", 22, 37, ["linear_num_key_heads=4", "linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=16", "linear_conv_kernel_dim=3", 'layer_types=["linear_attention","full_attention","linear_attention","full_attention"]', "head_dim=32", "rope_parameters.mrope_section=[2,1,1]"], False),
    ("q35_k2v2_vd24_two_full_rope05", "qwen3_5_moe", 23, 44, ["num_hidden_layers=5", "linear_num_key_heads=2", "linear_num_value_heads=2", "linear_value_head_dim=24", 'layer_types=["linear_attention","linear_attention","full_attention","full_attention",' '"linear_attention"]', "num_attention_heads=8", "num_key_value_heads=2", "num_experts_per_tok=3", "rope_parameters.partial_rotary_factor=0.5", "rope_parameters.mrope_section=[2,2,0]"], False),
    # Kimi Delta Attention (kimi_linear): other KDA head counts / dims and conv sizes, MLA first, KDA and
    # MLA alternating, q_lora MLA, no or two dense-first layers, 2 shared experts, expert groups 4/2 and
    # R3 without renorm.
    ("kimi_linear_h2d24_conv3_mla_first", "kimi_linear", 31, 40, ["linear_num_heads=2", "linear_head_dim=24", "linear_conv_kernel_dim=3", 'layer_types=["full_attention","linear_attention","linear_attention","full_attention"]', 'mlp_layer_types=["sparse","sparse","sparse","sparse"]'], False),
    ("kimi_linear_h8d8_conv2_alternate_qlora", "kimi_linear", 32, 36, ["num_hidden_layers=5", "linear_num_heads=8", "linear_head_dim=8", "linear_conv_kernel_dim=2", 'layer_types=["linear_attention","full_attention","linear_attention","full_attention",' '"linear_attention"]', 'mlp_layer_types=["dense","dense","sparse","sparse","sparse"]', "q_lora_rank=24", "n_shared_experts=2", "num_experts_per_tok=3"], False),
    ("kimi_linear_groups4_norenorm_heads2", "kimi_linear", 33, 44, ["n_group=4", "topk_group=2", "norm_topk_prob=false", "routed_scaling_factor=1.0", "num_attention_heads=2", "num_key_value_heads=2", "kv_lora_rank=24", "qk_rope_head_dim=16", "v_head_dim=24", "linear_num_heads=3", "linear_head_dim=16", 'layer_types=["linear_attention","linear_attention","full_attention","linear_attention"]'], False),
    # GLM-5-Next (glm5_next): 3 and 1 mHC streams, other Sinkhorn iterations, KDA lower bounds (-2, none),
    # k-pools 2 and 8 with other top-k, indexed layers first / twice full before a shared one, other KDA
    # shapes and conv 2, two dense-first layers. (index_kpool_always_select_tail=false is left out: in
    # transformers 5.23.0 the one-call forward is then not causal, a prompt's logits at position t change
    # with the tokens after t, so no cached engine can match it.)
    ("glm5n_hc3_sinkhorn7_lb2", "glm5_next", 41, 40, ["hc_mult=3", "hc_sinkhorn_iters=7", "linear_lower_bound=-2.0"], False),
    ("glm5n_kpool2_topk6_schedule", "glm5_next", 42, 44, ["num_hidden_layers=5", "index_kpool=2", "index_topk=6", 'layer_types=["indexed_attention","linear_attention","indexed_attention","indexed_attention",' '"linear_attention"]', 'indexer_types=["full","full","full","shared","full"]', 'mlp_layer_types=["sparse","sparse","sparse","sparse","sparse"]', "hc_sinkhorn_iters=3"], False),
    ("glm5n_kda_h2d24_conv2_kpool8_nolb", "glm5_next", 43, 38, ["linear_num_heads=2", "linear_head_dim=24", "linear_conv_kernel_dim=2", "linear_lower_bound=null", "index_kpool=8", "index_topk=16", "hc_mult=1", 'mlp_layer_types=["dense","dense","sparse","sparse"]'], False),
    # MiniMax-M2: one key/value head, a quarter of each head rotated, top-3 of 8; and 4/4 heads, rotary 0.75, 3 layers.
    ("minimax_kv1_rope025_top3", "minimax_m2", 51, 40, ["num_key_value_heads=1", "rope_parameters.partial_rotary_factor=0.25", "num_experts_per_tok=3"], False),
    ("minimax_kv4_rope075_3layers", "minimax_m2", 52, 38, ["num_key_value_heads=4", "rope_parameters.partial_rotary_factor=0.75", "num_hidden_layers=3"], False),
    # gpt-oss: windows far below the prompt, clamps that bind, other head layouts and yarn settings.
    ("gptoss_window4_limit05_full_first", "gpt_oss", 61, 40, ["num_hidden_layers=3", "sliding_window=4", "swiglu_limit=0.5", 'layer_types=["full_attention","sliding_attention","sliding_attention"]'], False),
    ("gptoss_kv1_top3_alpha09_yarn8", "gpt_oss", 62, 36, ["num_key_value_heads=1", "num_experts_per_tok=3", "swiglu_alpha=0.9", "sliding_window=7", "rope_parameters.truncate=true", "rope_parameters.factor=8.0"], False),
    ("gptoss_heads8_window2_limit1", "gpt_oss", 63, 38, ["num_attention_heads=8", "num_key_value_heads=4", "head_dim=8", "sliding_window=2", "swiglu_limit=1.0"], False),
    # Inkling: a window (5) and relative extents (5 / 12) below the prompt, log scaling that binds from
    # position 2, one full-attention kv head beside 4 sliding ones, full attention first and twice, two
    # dense layers, a padded head cut to 300 logits; and 8 sliding heads of 8 with another kv count, conv
    # kernel 3, one shared expert, top-3, no log scaling, another muP multiplier.
    ("inkling_window5_nfloor2_kv1_unpadded", "inkling", 61, 40, ["num_hidden_layers=5", "sliding_window_size=5", "rel_extent=12", "log_scaling_n_floor=2", "num_key_value_heads=1", "swa_num_key_value_heads=4", 'layer_types=["hybrid","hybrid_sliding","hybrid_sliding","hybrid","hybrid_sliding"]', "dense_mlp_idx=2", "unpadded_vocab_size=300"], False),
    ("inkling_swa8x8_conv3_shared1_top3", "inkling", 62, 38, ["swa_num_attention_heads=8", "swa_head_dim=8", "swa_num_key_value_heads=2", "conv_kernel_size=3", "n_shared_experts=1", "num_experts_per_tok=3", "log_scaling_n_floor=null", "logits_mup_width_multiplier=4.0", "rel_extent=40"], False),
    # Inkling 2: three-layer blocks over five layers with full attention first (no attention residual on
    # layer 0) and fourth, L2 clips, SwiGLU softcaps and the logit softcap all binding, a window of 5,
    # log scaling from position 2, a head cut to 320 logits; and one-layer blocks, one full-attention kv
    # head, 8 sliding heads of 8, conv kernel 3, a relative extent above the prompt, top-3.
    ("inkling2_blocks3_fullfirst_clips_bind", "inkling2", 71, 40, ["num_hidden_layers=5", "n_layers_per_attn_res_block=3", 'layer_types=["hybrid","hybrid_sliding","hybrid_sliding","hybrid","hybrid_sliding"]', "qk_l2_clip_threshold=2.0", "rel_l2_clip_threshold=0.5", "mlp_gate_softcap=0.5", "mlp_up_softcap=0.3", "final_logit_softcapping=1.5", "sliding_window_size=5", "log_scaling_n_floor=2", "unpadded_vocab_size=320"], False),
    ("inkling2_block1_kv1_swa8x8_conv3", "inkling2", 72, 38, ["n_layers_per_attn_res_block=1", "num_key_value_heads=1", "swa_num_attention_heads=8", "swa_head_dim=8", "swa_num_key_value_heads=4", "conv_kernel_size=3", "rel_extent=48", "num_experts_per_tok=3"], False),
]
VARIANT_NAMES = [v[0] for v in VARIANTS]


def _import(name):
    return getattr(transformers, name)


def make_simple(config_cls, model_cls):
    def make(text_kwargs, top_kwargs, vision_kwargs):
        cfg = _import(config_cls)(**text_kwargs)
        return _import(model_cls), cfg
    return make


def make_kimi_k25(text_kwargs, top_kwargs, vision_kwargs):
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    vision = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])
    vision.update(vision_kwargs)
    top = dict(text_config=text_kwargs, vision_config=vision, projection_hidden_size=32,
               tie_word_embeddings=False)
    top.update(top_kwargs)
    cfg = Kimi_K25Config(**top)
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration
    return Kimi_K25ForConditionalGeneration, cfg


def make_glm5_next(text_kwargs, top_kwargs, vision_kwargs):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, image_size=28, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text_kwargs["hidden_size"],
                  projection_intermediate_size=64)
    vision.update(vision_kwargs)
    top = dict(text_config=text_kwargs, vision_config=vision, tie_word_embeddings=False)
    top.update(top_kwargs)
    cfg = Glm5NextConfig(**top)
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    return Glm5NextForConditionalGeneration, cfg


ARCHS = {
    # name: (text config builder, model factory, description of what it exercises)
    "llama": (cfg_llama, make_simple("LlamaConfig", "LlamaForCausalLM"),
              "dense baseline, GQA 4/2, llama3 rope scaling"),
    "mixtral": (cfg_mixtral, make_simple("MixtralConfig", "MixtralForCausalLM"),
                "R2 router (softmax, top-2 renorm), w1/w2/w3 experts, sliding window 24 < prompt"),
    "olmoe": (cfg_olmoe, make_simple("OlmoeConfig", "OlmoeForCausalLM"),
              "full-width q/k RMSNorm, R1 router without renorm"),
    "qwen3_moe": (cfg_qwen3_moe, make_simple("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                  "per-head q/k norm, head_dim 24 != D/H, norm_topk_prob, dense layer 1 (mlp_only_layers)"),
    "minimax_m2": (cfg_minimax_m2, make_simple("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
                   "R4 sigmoid+bias router, full-width q/k norm, partial rope 0.5"),
    "glm4_moe": (cfg_glm4_moe, make_simple("Glm4MoeConfig", "Glm4MoeForCausalLM"),
                 "R3 router with 2 groups/topk_group 1, shared expert, dense-first, qkv bias, qk norm, "
                 "partial rope 0.5"),
    "gpt_oss": (cfg_gpt_oss, make_simple("GptOssConfig", "GptOssForCausalLM"),
                "sinks, sliding(12)/full alternation, yarn (truncate=False), biased clamped GLU, fused "
                "interleaved experts with biases"),
    "deepseek_v3": (cfg_deepseek_v3, make_simple("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                    "MLA (q_lora), interleaved rope, yarn mscale^2, R3 with 4 groups/topk_group 2, shared "
                    "expert, dense-first"),
    "kimi_k25": (cfg_kimi_k25, make_kimi_k25,
                 "Kimi_K25ForConditionalGeneration (tiny vision tower), deepseek_v3 text with n_group 1, "
                 "yarn; saved names renamed blocks->layers"),
    "kimi_linear": (cfg_kimi_linear, make_simple("KimiLinearConfig", "KimiLinearForCausalLM"),
                    "KDA linear attention + NoPE MLA (q_proj, no q_lora), shared expert, dense-first"),
    "glm_moe_dsa": (cfg_glm_moe_dsa, make_simple("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
                    "MLA + DSA lightning indexer (topk 6 < prompt), indexer types full/full/shared"),
    "qwen3_next": (cfg_qwen3_next, make_simple("Qwen3NextConfig", "Qwen3NextForCausalLM"),
                   "gated DeltaNet (qkvz grouped), gated attention, 1+w norms, gated shared expert"),
    "qwen3_5_moe": (cfg_qwen3_5_moe, make_simple("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                    "text class: un-grouped GDN projections, mrope (text-only = partial rope), R1'"),
    "inkling": (cfg_inkling, make_simple("InklingTextConfig", "InklingForCausalLM"),
                "text class: RoPE-free attention, short convs, relative bias (extent 16), window 8, log "
                "scaling, R6 router with 2 shared experts, dense layer 0, mup logit scale"),
    "inkling2": (cfg_inkling2, make_simple("Inkling2TextConfig", "Inkling2ForCausalLM"),
                 "text class: block attention residuals (block 2), dynamic convs, per-token sinks, L2 clips, "
                 "softcaps, window 8"),
    "glm5_next": (cfg_glm5_next, make_glm5_next,
                  "Glm5NextForConditionalGeneration (tiny vision): KDA + NoPE MLA with k-pool DSA "
                  "(kpool 4, topk 8), mHC (2 streams), clamped SwiGLU"),
    "deepseek_v4": (cfg_deepseek_v4, make_simple("DeepseekV4Config", "DeepseekV4ForCausalLM"),
                    "mHC, hash routing (2 layers), HCA(8)/CSA(4)+indexer(topk 2)/sliding(6), sinks, grouped "
                    "output, sqrtsoftplus router"),
}
ARCH_ORDER = list(ARCHS)


# ----------------------------------------------------------------------------------------------------------
# --set parsing
# ----------------------------------------------------------------------------------------------------------

def parse_value(s):
    try:
        return json.loads(s)
    except Exception:
        pass
    low = s.strip()
    if low in ("True", "False"):
        return low == "True"
    if low == "None":
        return None
    return s


def set_nested(d, dotted, value):
    parts = dotted.split(".")
    for p in parts[:-1]:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[parts[-1]] = value


def split_overrides(sets):
    text, top, vision = {}, {}, {}
    for item in sets or []:
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        key, val = item.split("=", 1)
        val = parse_value(val)
        if key.startswith("top."):
            set_nested(top, key[4:], val)
        elif key.startswith("vision_config."):
            set_nested(vision, key[len("vision_config."):], val)
        else:
            set_nested(text, key, val)
    return text, top, vision


def merge(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------

def build_tokenizer(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(
            f"tokenizer training reached {got} tokens, not vocab_size={vocab_size} "
            f"(the built-in corpus supports at most ~{got}); choose a smaller vocab_size")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tokenizer_config_dict(tok):
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }


def make_prompt(tok, n_tokens, seed, attempt):
    """Deterministic ASCII prompt whose tokenization is exactly n_tokens ids, or None."""
    ns = len(PROMPT_SENTENCES)
    start = (seed * 5 + attempt) % ns
    # Alternate the sentence stride too so that attempts beyond ns still differ.
    stride = 1 + (attempt // ns) % (ns - 1)
    text, i = "", 0
    while True:
        sent = PROMPT_SENTENCES[(start + i * stride) % ns]
        text = sent if not text else text + " " + sent
        i += 1
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) >= n_tokens + 2:
            break
        if i > 10 * ns:
            return None
    ids = ids[:n_tokens]
    cut = tok.decode(ids, skip_special_tokens=False)
    if not cut.isascii() or tok.encode(cut, add_special_tokens=False).ids != ids:
        return None
    return cut, ids


# ----------------------------------------------------------------------------------------------------------
# Randomising constant-initialised parameters (arch doc section 3.1)
# ----------------------------------------------------------------------------------------------------------

def randomise_constants(model, seed):
    g = torch.Generator().manual_seed(1_000_003 + seed)
    done = []

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    # Parameters plus persistent buffers (e.g. e_score_correction_bias is a buffer in several models);
    # non-persistent buffers such as rotary inv_freq are derived from the config and left alone.
    persistent = set(model.state_dict().keys())
    tensors = list(model.named_parameters(remove_duplicate=True))
    tensors += [(n, b) for n, b in model.named_buffers(remove_duplicate=True) if n in persistent]
    with torch.no_grad():
        seen = set()
        for name, p in tensors:
            if id(p) in seen:
                continue
            seen.add(id(p))
            leaf = name.rsplit(".", 1)[-1]
            if not p.dtype.is_floating_point:
                continue
            if leaf in ("sinks", "attn_sink"):
                p.copy_(normal(p.shape, 0.5).to(p.dtype))
                done.append((name, "N(0,0.5)"))
                continue
            if leaf in ("gate_up_proj_bias", "down_proj_bias"):
                p.copy_(normal(p.shape, 0.3).to(p.dtype))
                done.append((name, "N(0,0.3)"))
                continue
            if leaf in ("position_bias", "ape") or leaf.endswith("_ape"):
                p.copy_(normal(p.shape, 0.5).to(p.dtype))
                done.append((name, "N(0,0.5)"))
                continue
            if leaf == "index_kpool_compress_gate" or name.endswith("index_kpool_compress_gate.weight"):
                p.copy_(normal(p.shape, 0.5).to(p.dtype))
                done.append((name, "N(0,0.5)"))
                continue
            if p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            val = float(flat[0])
            is_norm = "norm" in name.lower()
            is_bias = "bias" in leaf.lower()
            if val == 1.0:
                std = 0.1 if is_norm else 0.2
                p.copy_((1.0 + normal(p.shape, std)).to(p.dtype))
                done.append((name, f"1+N(0,{std})"))
            elif val == 0.0:
                if is_norm and not is_bias:
                    p.copy_(normal(p.shape, 0.1).to(p.dtype))
                    done.append((name, "N(0,0.1)"))
                elif is_bias:
                    p.copy_(uniform(p.shape, 0.0, 0.5).to(p.dtype))
                    done.append((name, "U[0,0.5)"))
                else:
                    p.copy_(normal(p.shape, 0.5).to(p.dtype))
                    done.append((name, "N(0,0.5)"))
            else:
                p.copy_((val + normal(p.shape, 0.2 * max(abs(val), 1.0))).to(p.dtype))
                done.append((name, f"{val}+N(0,{0.2 * max(abs(val), 1.0):g})"))
        # Hash-routing tables (DeepSeek V4 tid2eid): random distinct expert ids per token.
        for name, b in list(model.named_buffers()) + list(model.named_parameters()):
            if name.rsplit(".", 1)[-1] != "tid2eid":
                continue
            V, k = b.shape
            n_exp = _n_experts_for(model, name)
            perm = torch.rand((V, n_exp), generator=g).argsort(dim=1)[:, :k]
            b.copy_(perm.to(b.dtype))
            done.append((name, f"distinct ids in [0,{n_exp})"))
    return done


def _n_experts_for(model, tid_name):
    mod_name = tid_name.rsplit(".", 1)[0]
    mod = model.get_submodule(mod_name)
    for attr in ("n_routed_experts", "num_experts"):
        if hasattr(mod, attr):
            return int(getattr(mod, attr))
    if hasattr(mod, "weight"):
        return int(mod.weight.shape[0])
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "n_routed_experts"))


# ----------------------------------------------------------------------------------------------------------
# Model build / forward helpers
# ----------------------------------------------------------------------------------------------------------

def text_config_of(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def build_model(arch, seed, text_over, top_over, vision_over):
    cfg_fn, factory, _ = ARCHS[arch]
    base = dict(COMMON_TEXT)
    base.update(cfg_fn(DEFAULT_VOCAB))
    text_kwargs = merge(base, text_over)
    n = text_kwargs["num_hidden_layers"]
    for key, fn in PER_LAYER.get(arch, {}).items():
        if key not in text_over:
            text_kwargs[key] = fn(n)
    ids = dict(bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN), eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
               pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN))
    for k, v in ids.items():
        text_kwargs.setdefault(k, v)
    model_cls, cfg = factory(text_kwargs, top_over, vision_over)
    for k, v in ids.items():
        if hasattr(cfg, k) and k not in top_over:
            setattr(cfg, k, v)
    torch.manual_seed(seed)
    np.random.seed(seed)
    kwargs = dict(attn_implementation="eager", dtype=torch.float32)
    try:
        model = model_cls._from_config(cfg, experts_implementation="eager", **kwargs)
    except (ValueError, TypeError) as e:
        if "experts" not in str(e).lower():
            raise
        model = model_cls._from_config(cfg, **kwargs)
    model.eval()
    randomised = randomise_constants(model, seed)
    return model, randomised


class RouterRecorder:
    """Records the top-k expert ids/weights handed to every routed-experts module."""

    def __init__(self, model):
        self.handles = []
        self.records = {}
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if not cls.endswith("Experts") or "Shared" in cls:
                continue
            m = re.search(r"(?:layers|blocks)\.(\d+)\.", name + ".")
            layer = int(m.group(1)) if m else name
            self.handles.append(mod.register_forward_pre_hook(self._hook(layer), with_kwargs=True))

    def _hook(self, layer):
        def fn(mod, args, kwargs):
            vals = list(args[1:]) + [kwargs[k] for k in ("top_k_index", "router_indices", "top_k_weights",
                                                         "routing_weights") if k in kwargs]
            idx = next((v for v in vals if torch.is_tensor(v) and not v.dtype.is_floating_point), None)
            w = next((v for v in vals if torch.is_tensor(v) and v.dtype.is_floating_point), None)
            if idx is None:
                return
            idx = idx.reshape(-1, idx.shape[-1])
            rec = {"ids": idx.tolist()}
            if w is not None and w.shape[-1] == idx.shape[-1]:
                rec["weights"] = [[float(np.float32(x)) for x in row] for row in w.reshape(idx.shape).tolist()]
            self.records[str(layer)] = rec
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


class TopkSpy:
    """Watches every torch.topk call made by the model (routers, group selection, sparse-attention indexers)
    and records, per call site, the smallest gap between the k-th and (k+1)-th candidate. A gap near zero
    is a discontinuity: another engine's ~1e-6 rounding could flip the selection (exact ties, e.g. ReLU
    indexer scores that are all zero, are even resolved by implementation-defined order). Candidates that
    are masked out (<= -1e30) are ignored."""

    MASKED = -1e30

    def __init__(self):
        self.min_gap = {}
        # Per site: how many rows tie exactly at the k-th place, and the smallest gap that is not 0.
        self.ties = {}
        self.min_nonzero_gap = {}

    def __enter__(self):
        self._fn, self._meth = torch.topk, torch.Tensor.topk
        spy = self
        orig = self._fn

        def topk(input, k, dim=-1, largest=True, sorted=True, **kw):
            spy._observe(input, k, dim, largest)
            return orig(input, k, dim=dim, largest=largest, sorted=sorted, **kw)

        def meth(self_, k, dim=-1, largest=True, sorted=True):
            spy._observe(self_, k, dim, largest)
            return orig(self_, k, dim=dim, largest=largest, sorted=sorted)

        torch.topk, torch.Tensor.topk = topk, meth
        return self

    def __exit__(self, *exc):
        torch.topk, torch.Tensor.topk = self._fn, self._meth
        return False

    def _observe(self, x, k, dim, largest):
        n = x.shape[dim]
        if k >= n or k <= 0:
            return
        v = x.detach().float()
        if not largest:
            v = -v
        top = self._fn(v, k + 1, dim=dim).values
        a = top.select(dim if dim >= 0 else top.dim() + dim, k - 1)
        b = top.select(dim if dim >= 0 else top.dim() + dim, k)
        valid = a > self.MASKED
        if not bool(valid.any()):
            return
        gaps = (a - b)[valid]
        gap = float(gaps.min())
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename == __file__:
            f = f.f_back
        site = f"{Path(f.f_code.co_filename).name}:{f.f_lineno}:{f.f_code.co_name}" if f else "?"
        self.min_gap[site] = min(gap, self.min_gap.get(site, float("inf")))
        self.ties[site] = self.ties.get(site, 0) + int((gaps == 0).sum())
        nonzero = gaps[gaps != 0]
        if nonzero.numel():
            self.min_nonzero_gap[site] = min(float(nonzero.min()), self.min_nonzero_gap.get(site, float("inf")))

    @property
    def overall(self):
        return min(self.min_gap.values()) if self.min_gap else float("inf")

    @property
    def overall_nonzero(self):
        """The smallest gap that is not an exact tie (exact ties are reproducible: an engine that breaks
        them as torch.topk does gets the same pick; near-ties are not)."""
        return min(self.min_nonzero_gap.values()) if self.min_nonzero_gap else float("inf")

    @property
    def total_ties(self):
        return sum(self.ties.values())


@torch.no_grad()
def forward_logits(model, ids):
    inp = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=inp, attention_mask=torch.ones_like(inp), use_cache=False)
    return out.logits[0].detach().float().clone()


@torch.no_grad()
def greedy_manual(model, ids, n_new):
    seq = list(ids)
    margins = []
    for _ in range(n_new):
        logits = forward_logits(model, seq)[-1]
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    return seq[len(ids):], margins


@torch.no_grad()
def greedy_generate(model, ids, n_new, gen_cfg):
    inp = torch.tensor([ids], dtype=torch.long)
    out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), generation_config=gen_cfg,
                         do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
    return out[0, len(ids):].tolist()


# ----------------------------------------------------------------------------------------------------------
# Output helpers
# ----------------------------------------------------------------------------------------------------------

def f32_str(x):
    """Shortest decimal that parses back (as f32, or as f64 then cast to f32) to exactly this float32."""
    v = np.float32(x)
    if not np.isfinite(v):
        raise ValueError(f"non-finite logit {v}")
    s = str(v)
    if "." not in s and "e" not in s and "inf" not in s and "nan" not in s:
        s += ".0"
    if np.float32(float(s)) != v:  # pragma: no cover - fall back to the exact double repr
        s = repr(float(v))
    return s


def write_reference(path, ref, logits):
    items = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in ref.items()
             if k not in ("router", "randomised_params")]
    rows = ",\n  ".join("[" + ", ".join(f32_str(x) for x in row) + "]" for row in logits.tolist())
    body = "{\n" + ",\n".join(items) + ',\n "logits": [\n  ' + rows + "\n ]"
    if "router" in ref:
        body += ',\n "router": ' + json.dumps(ref["router"], separators=(",", ":"))
    if "randomised_params" in ref:
        body += ',\n "randomised_params": ' + json.dumps(ref["randomised_params"], indent=1)
    body += "\n}\n"
    json.loads(body)  # sanity
    Path(path).write_text(body)


def rename_kimi_blocks(st_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors, meta = {}, None
    with safe_open(st_path, framework="pt") as f:
        meta = f.metadata()
        for k in f.keys():
            nk = re.sub(r"^language_model\.model\.blocks\.", "language_model.model.layers.", k)
            tensors[nk] = f.get_tensor(k)
    save_file(tensors, st_path, metadata=meta or {"format": "pt"})


POST_SAVE = {"kimi_k25": rename_kimi_blocks}


def dir_size(d):
    return sum(p.stat().st_size for p in Path(d).iterdir() if p.is_file())


# ----------------------------------------------------------------------------------------------------------
# Main per-arch routine
# ----------------------------------------------------------------------------------------------------------

def generate(arch, out_root, seed, prompt_len, sets, verify=True, allow_ties=False, name=None):
    """Write the fixture `<out_root>/<name or arch>`. With `allow_ties`, exact ties at a top-k boundary
    (all-zero ReLU indexer scores) are accepted and only the non-zero gaps must clear MIN_TOPK_MARGIN."""
    t0 = time.time()
    text_over, top_over, vision_over = split_overrides(sets)
    model, randomised = build_model(arch, seed, text_over, top_over, vision_over)
    cfg = model.config
    tcfg = text_config_of(cfg)
    V = int(tcfg.vocab_size)
    # A head padded past the real tokens (Inkling's unpadded_vocab_size): the tokenizer holds only those.
    unpadded = getattr(tcfg, "unpadded_vocab_size", None)
    n_tokens = unpadded if unpadded is not None and unpadded < V else V
    tok = build_tokenizer(n_tokens)
    eos_id = tok.token_to_id(EOS_TOKEN)
    special_ids = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    gen_cfg = GenerationConfig(bos_token_id=tok.token_to_id(BOS_TOKEN), eos_token_id=eos_id,
                               pad_token_id=tok.token_to_id(PAD_TOKEN), do_sample=False)

    best = None
    for attempt in range(MAX_PROMPT_ATTEMPTS):
        pr = make_prompt(tok, prompt_len, seed, attempt)
        if pr is None:
            continue
        text, ids = pr
        greedy, margins = greedy_manual(model, ids, GREEDY_NEW_TOKENS)
        if any(t in special_ids for t in greedy):
            continue
        # Causal model: one forward over prompt + greedy[:-1] sees every selection made at every step.
        with TopkSpy() as spy:
            forward_logits(model, ids + greedy[:-1])
        gap = spy.overall_nonzero if allow_ties else spy.overall
        score = min(min(margins) / MIN_GREEDY_MARGIN, gap / MIN_TOPK_MARGIN)
        cand = (score, attempt, text, ids, greedy, margins, spy)
        if best is None or cand[0] > best[0]:
            best = cand
        if score >= 1.0:
            break
    if best is None:
        raise RuntimeError(f"{arch}: no prompt without special tokens in the greedy continuation")
    score, attempt, text, ids, greedy, margins, spy = best
    min_margin = min(margins)
    if min_margin < MIN_GREEDY_MARGIN:
        print(f"  WARNING {arch}: best greedy margin {min_margin:.2e} < {MIN_GREEDY_MARGIN}")
    gap = spy.overall_nonzero if allow_ties else spy.overall
    if gap < MIN_TOPK_MARGIN:
        print(f"  WARNING {arch}: smallest top-k selection gap {gap:.2e} < {MIN_TOPK_MARGIN} "
              f"{spy.min_gap} (non-zero: {spy.min_nonzero_gap})")
    if spy.total_ties:
        print(f"  note {arch}: {spy.total_ties} exact ties at a top-k boundary {spy.ties}")

    rec = RouterRecorder(model)
    logits = forward_logits(model, ids)
    rec.remove()
    gen = greedy_generate(model, ids, GREEDY_NEW_TOKENS, gen_cfg)
    generate_agrees = gen == greedy
    if not generate_agrees:
        print(f"  WARNING {arch}: model.generate (kv cache) {gen} != manual argmax loop {greedy}")

    out_dir = Path(out_root) / (name or arch)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for extra in out_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "generation_config.json"):
            raise RuntimeError(f"{arch}: unexpected file written by save_pretrained: {extra.name}")
    if arch in POST_SAVE:
        POST_SAVE[arch](str(out_dir / "model.safetensors"))
    os.chmod(out_dir / "model.safetensors", 0o644)
    gen_cfg.save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_dict(tok), indent=2) + "\n")

    assert tok.encode(text, add_special_tokens=False).ids == ids
    ref = {
        "arch": arch,
        "model_type": cfg.model_type,
        "text_model_type": tcfg.model_type,
        "class": type(model).__name__,
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "dtype": "float32",
        "vocab_size": V,
        "tokenizer_size": n_tokens,
        "eos_token_id": eos_id,
        "prompt_text": text,
        "prompt_ids": ids,
        "prompt_attempt": attempt,
        "logits_shape": list(logits.shape),
        "greedy_ids": greedy,
        "greedy_text": tok.decode(greedy, skip_special_tokens=False),
        "greedy_min_margin": min_margin,
        "topk_min_gap": spy.overall if spy.min_gap else None,
        "topk_min_gap_by_site": spy.min_gap,
        "generate_agrees": generate_agrees,
        "generate_ids": gen,
        "generate_text": tok.decode(gen, skip_special_tokens=False),
        "selection_ties": spy.total_ties,
        "selection_ties_by_site": spy.ties,
        "overrides": list(sets or []),
        "router": rec.records,
        "randomised_params": [f"{n}: {how}" for n, how in randomised],
    }
    write_reference(out_dir / "reference.json", ref, logits)

    summary = {"arch": name or arch, "bytes": dir_size(out_dir), "max_abs_logit": float(logits.abs().max()),
               "greedy": greedy, "margin": min_margin, "topk_gap": spy.overall, "generate_agrees": generate_agrees,
               "secs": time.time() - t0}
    if verify:
        summary.update(verify_fixture(arch, out_dir, model_cls=type(model)))
    summary["ties"] = spy.total_ties
    return summary


def verify_fixture(arch, out_dir, model_cls):
    """Reload the directory with from_pretrained and recompute everything from reference.json."""
    from transformers import AutoTokenizer

    ref = json.loads((Path(out_dir) / "reference.json").read_text())
    # Eager experts, as the reference was computed: the default grouped_mm sums in another
    # order and can differ by ~1e-6, which the exact reload check would report as a failure.
    model, info = model_cls.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32,
                                            experts_implementation="eager", output_loading_info=True)
    model.eval()
    # from_pretrained leaves the tensors in the memory-mapped file, where they are only 8-byte aligned; a
    # one-row matrix-vector product (e.g. qwen3_next's shared_expert_gate, [1, 64]) then sums in another
    # order than on the 64-byte aligned tensors the reference was computed with (a 1-ulp difference). Copy
    # every tensor to fresh storage so that the reload check compares values, not alignment.
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{arch}: reload problems: {bad}")
    logits = forward_logits(model, ref["prompt_ids"])
    want = torch.tensor(ref["logits"], dtype=torch.float32)
    diff = float((logits - want).abs().max())
    if diff != 0.0:
        raise RuntimeError(f"{arch}: reloaded logits differ by {diff}")
    greedy, _ = greedy_manual(model, ref["prompt_ids"], GREEDY_NEW_TOKENS)
    if greedy != ref["greedy_ids"]:
        raise RuntimeError(f"{arch}: reloaded greedy ids differ")
    gen_cfg = GenerationConfig(bos_token_id=0, eos_token_id=ref["eos_token_id"], pad_token_id=0, do_sample=False)
    if greedy_generate(model, ref["prompt_ids"], GREEDY_NEW_TOKENS, gen_cfg) != ref["generate_ids"]:
        raise RuntimeError(f"{arch}: reloaded generate() ids differ")
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    if hf_tok(ref["prompt_text"], add_special_tokens=False)["input_ids"] != ref["prompt_ids"]:
        raise RuntimeError(f"{arch}: AutoTokenizer encodes the prompt differently")
    if len(hf_tok) != ref.get("tokenizer_size", ref["vocab_size"]):
        raise RuntimeError(f"{arch}: AutoTokenizer vocab {len(hf_tok)} != {ref['vocab_size']}")
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat
    return {"reload_max_diff": diff}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", choices=ARCH_ORDER, help="architecture (repeatable)")
    ap.add_argument("--all", action="store_true", help="generate every architecture")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a (text) config field; repeatable")
    ap.add_argument("--no-verify", action="store_true", help="skip the reload check")
    ap.add_argument("--keep-going", action="store_true", help="continue with the next arch after a failure")
    ap.add_argument("--variants", action="store_true", help="generate the variant grid into <out>/variants")
    ap.add_argument("--variant", action="append", choices=VARIANT_NAMES, help="one variant of the grid (repeatable)")
    ap.add_argument("--allow-ties", action="store_true",
                    help="accept exact ties at a top-k boundary (only non-zero gaps must clear the margin)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: up to 4)")
    args = ap.parse_args(argv)

    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__} != pinned {EXPECTED_TRANSFORMERS}",
              file=sys.stderr)
    archs = ARCH_ORDER if args.all else (args.arch or [])
    jobs = [(a, args.out, args.seed, args.prompt_len, args.set, args.allow_ties, None) for a in archs]
    if args.variants or args.variant:
        for name, arch, seed, prompt_len, sets, allow_ties in VARIANTS:
            if args.variants or name in args.variant:
                jobs.append((arch, str(Path(args.out) / "variants"), seed, prompt_len, sets, allow_ties, name))
    if not jobs:
        ap.error("give --arch A (repeatable), --all, --variants or --variant NAME")
    torch.set_num_threads(args.threads or max(1, min(4, os.cpu_count() or 1)))

    rows, failed = [], []
    for arch, out, seed, prompt_len, sets, allow_ties, name in jobs:
        label = name or arch
        print(f"[{label}] generating ...", flush=True)
        try:
            s = generate(arch, out, seed, prompt_len, sets, verify=not args.no_verify, allow_ties=allow_ties,
                         name=name)
        except Exception as e:  # noqa: BLE001
            failed.append((label, f"{type(e).__name__}: {e}"))
            print(f"[{label}] FAILED: {type(e).__name__}: {e}", flush=True)
            if not args.keep_going:
                raise
            continue
        rows.append(s)
        print(f"[{label}] ok in {s['secs']:.1f}s", flush=True)

    print()
    print(f"{'arch':<13} {'bytes':>9} {'max|logit|':>10} {'margin':>8} {'topk_gap':>9} {'ties':>5} {'gen==loop':>9}  "
          f"greedy_ids")
    for s in rows:
        print(f"{s['arch']:<13} {s['bytes']:>9} {s['max_abs_logit']:>10.4f} {s['margin']:>8.4f} "
              f"{s['topk_gap']:>9.2e} {s['ties']:>5} {str(s['generate_agrees']):>9}  {s['greedy']}")
    for arch, why in failed:
        print(f"{arch:<13} FAILED {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
