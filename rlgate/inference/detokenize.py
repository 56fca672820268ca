"""Token ids to text, the way vLLM reports them, for any Hugging Face tokenizer.

Output text is decoded from the tokens' bytes with `errors="replace"`: a random (or any) byte-level
model can emit byte sequences that are not valid UTF-8, which then read as U+FFFD in `content`/`text`.
The token ids are the record (training never re-tokenizes text), so nothing is lost.

- `text(ids)`: output text, special tokens (e.g. `<|im_end|>`) skipped, as vLLM's default
  `skip_special_tokens=True`. Added tokens that are not special (`<tool_call>`) stay, as the hermes tool
  parser needs them.
- `token_str(id)` / `token_bytes(id)`: one token as vLLM's logprobs show it: `decode([id])` with special
  tokens kept, and that string's UTF-8 bytes (so a lone byte of a multi-byte character reads as U+FFFD,
  bytes [239, 191, 189]).
- `stream_pieces`: the text each token adds in a stream, holding back an incomplete character and, with
  stop strings, `len(longest stop) - 1` characters (vLLM's detokenizer does both), so the pieces
  concatenate to `text` exactly.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self._bytes: list[bytes] = []
        self._str: list[str] = []
        symbols = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        for token_id, symbol in enumerate(symbols):
            if token_id in added:
                raw = added[token_id].encode()
            else:
                symbol = symbol or ""
                if all(ch in byte_of for ch in symbol):  # byte-level BPE symbols (GPT-2 / Qwen / Llama 3)
                    raw = bytes(byte_of[ch] for ch in symbol)
                else:  # another scheme (sentencepiece, ...): trust the tokenizer's own decoding
                    raw = tokenizer.decode([token_id]).encode()
            self._bytes.append(raw)
            string = raw.decode("utf-8", "replace")
            self._str.append(string)

    def _raw(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def text(self, ids: list[int]) -> str:
        return b"".join(self._raw(t) for t in ids if t not in self.special_ids).decode("utf-8", "replace")

    def token_str(self, token_id: int) -> str:
        return self._str[token_id] if 0 <= token_id < len(self._str) else ""

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_str(token_id).encode())

    def stream_pieces(self, ids: list[int], final_text: str, stops: list[str]) -> list[str]:
        """Per token, the new text to stream; `"".join(pieces) == final_text`."""
        hold = max((len(s) - 1 for s in stops), default=0)
        pieces, sent = [], 0
        for i in range(len(ids)):
            if i == len(ids) - 1:
                upto = len(final_text)
            else:
                prefix = self.text(ids[: i + 1]).rstrip("\ufffd")  # an incomplete character waits
                upto = min(len(final_text), len(prefix) - hold)
            pieces.append(final_text[sent:upto] if upto > sent else "")
            sent = max(sent, upto)
        return pieces
