"""The embedded CPU inference backend of `rlgate serve` (issue 4): the tiny model built in code; the server
arrives next.

`build_tiny_model` writes a tiny Qwen2 causal LM with a byte-level tokenizer and a Hermes-style ChatML
chat template to a Hugging Face folder; `build_tokenizer` gives that tokenizer in memory.
"""

from inference.tiny_model import CHAT_TEMPLATE, build_tiny_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "build_tokenizer"]
