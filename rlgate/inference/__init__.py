"""The embedded CPU inference backend of `rlgate serve`.

`tiny_model` builds a tiny Qwen2 causal LM with a byte-level tokenizer and a Hermes-style ChatML chat
template in code; `engine` samples batches on the CPU with the log-probs of the distribution sampled from;
`scheduler` batches concurrent requests; `model`, `endpoints` and `server` answer in vLLM's wire format
(`server` documents the contract and the differences).
"""

from rlgate.inference.tiny_model import CHAT_TEMPLATE, build_tiny_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "build_tokenizer"]
