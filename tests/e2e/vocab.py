"""The tiny models' vocabulary and prompts, for the e2e tests (lives in kv_offload.tiny_vocab)."""

from kv_offload.tiny_vocab import (  # noqa: F401  (re-exported for the tests)
    BOS_ID,
    EOS_ID,
    NUM_WORDS,
    PAD_ID,
    VOCAB_SIZE,
    vocabulary,
    word_prompt,
)
