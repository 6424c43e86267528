"""The word-level vocabulary of the tiny local models, and prompts built from it.

Free of heavy imports so tests can build prompts at collection time. Every word "w0".."w499"
is one token and the tokenizer adds no BOS, so a prompt of n words is exactly n tokens.
"""

from __future__ import annotations

NUM_WORDS = 500
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS))
VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_WORDS


def word_prompt(num_tokens: int, offset: int = 0) -> str:
    """A prompt of exactly `num_tokens` word tokens, starting at word `offset`."""
    return " ".join(f"w{(offset + i) % NUM_WORDS}" for i in range(num_tokens))


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first, then "w0".."w499"."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": len(SPECIAL_TOKENS) + i for i in range(NUM_WORDS)})
    return vocab
