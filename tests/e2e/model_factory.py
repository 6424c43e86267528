"""Tiny local models for end-to-end tests against the real vLLM CPU engine.

Each builder writes a Hugging Face model directory (config, random weights from a fixed seed,
and a word-level tokenizer, see vocab.py) that vLLM can load with no download. Prompts are
plain words "w0 w1 ..." so a test controls exactly how many tokens it sends.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, vocabulary


def _save_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(str(path))


def _save(model: torch.nn.Module, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path)
    return path


def build_llama(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """A Llama-like decoder with random weights (grouped-query attention, head_dim 32)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype)
    return _save(model, Path(path))


def build_gemma3(
    path: str | Path,
    *,
    num_layers: int = 4,
    full_attention_every: int = 2,
    sliding_window: int = 64,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """A Gemma3-like text model mixing sliding-window and full-attention layers.

    Every `full_attention_every`-th layer is full attention, the others slide over
    `sliding_window` tokens, so vLLM builds two KV-cache groups.
    """
    torch.manual_seed(seed)
    layer_types = [
        "full_attention" if (i + 1) % full_attention_every == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=layer_types,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config).to(dtype)
    return _save(model, Path(path))


BUILDERS = {"llama": build_llama, "gemma3": build_gemma3}
