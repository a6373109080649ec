"""Tiny causal LMs built locally (no hub download): for the toy loop and for tests.

A tiny model is a real HF transformers model folder (config, safetensors weights, tokenizer),
so it goes through exactly the same loading code as a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]
# Whitespace-separated words: digits, operators and a few words for toy domains.
WORDS = [*(str(d) for d in range(10)), "+", "-", "=", "?", "copy", "next", "add", "sum", "max", "min", "reverse"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                   clean_up_tokenization_spaces=False)


def build_tiny_model(out_dir: str | Path, hidden_size: int = 64, layers: int = 2, heads: int = 2,
                     seed: int = 0, context: int = 128) -> Path:
    """Write a randomly initialised Llama-architecture model and its tokenizer to ``out_dir``.

    ``context``: its context length in tokens (max_position_embeddings), prompt and completion together
    (real datasets' prompts, e.g. HumanEval's, run to a few hundred).

    head_dim = hidden_size / heads must be one the vLLM CPU backend supports (32, 64, ...).
    Deterministic for a given ``seed``.
    """
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_tiny_model(out_dir: str | Path, **kwargs) -> Path:
    """Build the tiny model unless ``out_dir`` already holds one built with the same recipe."""
    out = Path(out_dir)
    recipe = json.dumps({"words": WORDS, "special": SPECIAL, **kwargs}, sort_keys=True)
    marker = out / "temper-tiny-recipe.json"
    if not marker.exists() or marker.read_text() != recipe:
        build_tiny_model(out, **kwargs)
        marker.write_text(recipe)
    return out
