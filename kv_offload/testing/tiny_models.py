"""Tiny local models with random weights that vLLM loads with no download.

Each builder writes a Hugging Face model directory: a config, random weights from a fixed
seed (safetensors) and a word-level tokenizer (see tiny_vocab.py). Sizes are keyword
arguments so tests use a very small model and benchmarks or the demo a bigger one.
transformers and tokenizers (installed with vllm) are imported only inside the builders, so
`import kv_offload` never needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kv_offload.testing.tiny_vocab import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    vocabulary,
    word_prompt,
)

__all__ = ["BUILDERS", "build_gemma3", "build_granite_hybrid", "build_llama", "build_qwen3_next",
           "word_prompt"]


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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


def _save(model: Any, path: Path) -> Path:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar for a few MB is noise
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path)
    return path


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (expected e.g. 'bfloat16')")
    return dtype


def _decoder_config(*, layers: int, hidden: int, heads: int, kv_heads: int,
                    intermediate: int | None, max_positions: int) -> dict[str, Any]:
    """The config keywords every builder shares: sizes and our vocabulary's token ids."""
    return dict(vocab_size=VOCAB_SIZE, hidden_size=hidden,
                intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=max_positions, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def _layer_types(layers: int, full_attention_every: int, other: str) -> list[str]:
    """Every `full_attention_every`-th layer full attention, the others `other`."""
    return ["full_attention" if (i + 1) % full_attention_every == 0 else other
            for i in range(layers)]


def build_llama(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Llama-like decoder with random weights; head size is `hidden // heads`.

    `kv_heads < heads` gives grouped-query attention; `intermediate` defaults to 2 * hidden.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **_decoder_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(_torch_dtype(dtype))
    return _save(model, Path(path))


def build_gemma3(
    path: str | Path,
    *,
    layers: int = 4,
    full_attention_every: int = 2,
    sliding_window: int = 64,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int | None = None,
    max_positions: int = 2048,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Gemma3-like text model mixing sliding-window and full-attention layers.

    Every `full_attention_every`-th layer is full attention, the others slide over
    `sliding_window` tokens, so vLLM builds two KV-cache groups.
    """
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    layer_types = _layer_types(layers, full_attention_every, "sliding_attention")
    config = Gemma3TextConfig(
        **_decoder_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=layer_types,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config).to(_torch_dtype(dtype))
    return _save(model, Path(path))


def _strengthen_recurrence(model: Any, *, a_log: float, input_scale: float) -> None:
    """Make the recurrent layers' state matter to the output.

    With default random weights a GatedDeltaNet / Mamba2 layer forgets its state within a few
    tokens and its input projection is tiny, so a model whose state was never restored decodes
    almost like one whose state was: a test could not tell. A very negative `A_log` slows the
    decay (the state carries over the whole prompt) and `input_scale` enlarges what enters it.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                param.fill_(a_log)
            elif name.endswith(("in_proj_qkvz.weight", "in_proj.weight")):
                param.mul_(input_scale)


def build_qwen3_next(
    path: str | Path,
    *,
    layers: int = 4,
    full_attention_every: int = 4,
    hidden: int = 128,
    # Wide attention pages keep the unified block small (vLLM grows the attention block
    # until its page covers the recurrent state): 64 tokens with these defaults.
    heads: int = 8,
    kv_heads: int = 8,
    head_dim: int = 128,
    linear_heads: int = 1,
    linear_head_dim: int = 128,  # vLLM's CPU GatedDeltaNet kernel rejects 32
    experts: int = 4,
    intermediate: int | None = None,
    max_positions: int = 2048,
    a_log: float = -6.0,
    input_scale: float = 8.0,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Qwen3-Next-like hybrid: GatedDeltaNet (linear attention) layers with a full-attention
    layer every `full_attention_every`-th, small sparse-MoE MLPs. vLLM builds a Mamba-type
    group (`gdn_attention`) and an attention group. The recurrence is strengthened
    (`a_log`, `input_scale`) so a state that is not restored changes the output."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    layer_types = _layer_types(layers, full_attention_every, "linear_attention")
    config = Qwen3NextConfig(
        **_decoder_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions),
        head_dim=head_dim,
        linear_num_key_heads=linear_heads,
        linear_num_value_heads=2 * linear_heads,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        # vLLM's Qwen3-Next needs sparse-MoE layers: a few small experts.
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=intermediate or 2 * hidden,
        shared_expert_intermediate_size=intermediate or 2 * hidden,
        layer_types=layer_types,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    model = Qwen3NextForCausalLM(config)
    _strengthen_recurrence(model, a_log=a_log, input_scale=input_scale)
    return _save(model.to(_torch_dtype(dtype)), Path(path))


def build_granite_hybrid(
    path: str | Path,
    *,
    layers: int = 4,
    full_attention_every: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    mamba_heads: int = 4,
    mamba_head_dim: int = 32,
    mamba_state: int = 16,
    intermediate: int | None = None,
    max_positions: int = 2048,
    a_log: float = -6.0,
    input_scale: float = 8.0,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A Granite-4-like hybrid: Mamba2 layers with a full-attention layer every
    `full_attention_every`-th, dense MLPs. vLLM builds a Mamba2 group and an attention
    group; on vLLM CPU it needs `max_num_batched_tokens == block_size` (see the README)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    layer_types = _layer_types(layers, full_attention_every, "linear_attention")
    config = GraniteMoeHybridConfig(
        **_decoder_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, max_positions=max_positions),
        shared_intermediate_size=intermediate or 2 * hidden,
        num_local_experts=0,
        layer_types=layer_types,
        mamba_n_heads=mamba_heads,
        mamba_d_head=mamba_head_dim,
        mamba_n_groups=1,
        mamba_d_state=mamba_state,
        mamba_expand=mamba_heads * mamba_head_dim // hidden,
        position_embedding_type="rope",
        tie_word_embeddings=False,
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    model = GraniteMoeHybridForCausalLM(config)
    _strengthen_recurrence(model, a_log=a_log, input_scale=input_scale)
    return _save(model.to(_torch_dtype(dtype)), Path(path))


BUILDERS: dict[str, Callable[..., Path]] = {"llama": build_llama, "gemma3": build_gemma3,
                                            "qwen3_next": build_qwen3_next,
                                            "granite_hybrid": build_granite_hybrid}
