"""A tiny Qwen2-architecture causal LM with a byte-level tokenizer, built deterministically in code.

`build_tiny_model(path, seed=...)` writes a normal Hugging Face folder that `AutoModelForCausalLM` and
`AutoTokenizer` load offline, and that peft and vLLM can load (standard `qwen2` architecture):

| file | content |
|---|---|
| config.json | `Qwen2Config`: tied embeddings, float32, rope_theta 10000, 2048 positions |
| model.safetensors | random init (std 0.02) under `torch.manual_seed(seed)`; byte-identical per seed |
| generation_config.json | eos `[<|im_end|>, <|endoftext|>]`, pad and bos `<|endoftext|>` |
| tokenizer.json | `tokenizers` BPE over the 256 byte tokens, no merges; id of byte `b` is `b` |
| tokenizer_config.json | `PreTrainedTokenizerFast`, special tokens, `CHAT_TEMPLATE` |
| special_tokens_map.json | bos, eos, pad |

Token ids: bytes 0-255, then the added tokens in `ADDED_TOKENS` order (256-260). The model's vocabulary
is exactly `len(tokenizer)` = 261 (not rounded up), so every id the model can sample decodes. As in
Qwen2.5, `<tool_call>` and `</tool_call>` are added tokens with their own ids but not *special*: they
survive `decode(..., skip_special_tokens=True)`, which vLLM's hermes tool parser relies on. Encoding
NFC-normalizes text, as Qwen2.5's tokenizer does and as transformers 5 enforces when it loads any
`qwen2` folder (it rebuilds the pipeline as `Qwen2Tokenizer`), so that every loader (transformers 4 or 5,
or `tokenizers.Tokenizer.from_file`) gives the same ids: `decode(encode(text)) == NFC(text)`, which is
`text` itself for ASCII, emoji, CJK, newlines and any other text already in NFC.

The tokenizer files are written directly rather than by `save_pretrained`, whose output differs between
transformers 4 and 5 (5 writes `tokenizer_class: TokenizersBackend` and a separate `chat_template.jinja`,
which transformers 4, and vLLM releases pinned to it, cannot read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rlgate.inference.chat_template import chatml_tools_template

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# (content, special) in id order from 256; `special` as in Qwen2.5's tokenizer.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (PAD_TOKEN, True),
    (IM_START, True),
    (IM_END, True),
    (TOOL_CALL_START, False),
    (TOOL_CALL_END, False),
)
MAX_POSITIONS = 2048
DEFAULT_NUM_HEADS = 2  # head width 64 / 2 = 32: the smallest vLLM's CPU attention serves

CHAT_TEMPLATE = chatml_tools_template()


def build_tokenizer(corpus: Iterable[str] | None = None, merges: int = 0) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with its special tokens and `CHAT_TEMPLATE`, in memory.

    A BPE whose vocabulary is the 256 byte symbols of the GPT-2 byte-to-unicode map (id = byte value)
    and no merges, behind an NFC normalizer, a ByteLevel pre-tokenizer (no prefix space, no regex split)
    and a ByteLevel decoder. This gives the same ids as the pipeline transformers 5 rebuilds for every
    `qwen2` folder (`Qwen2Tokenizer`: NFC, Qwen's split regex, ByteLevel), because without merges the
    split cannot change the ids.

    With a `corpus` and `merges` > 0, the BPE also learns up to `merges` merges from the corpus (as real
    tokenizers are trained, so that frequent words and JSON keys are one token each) behind Qwen2's own
    split regex (digits stay one token each, as in Qwen2.5), the pre-tokenizer that transformers 5 rebuilds:
    every loader still gives the same ids. Bytes keep ids 0-255 and the added tokens 256-260; the merged
    symbols follow in merge order. The same corpus gives the same merges.
    """
    byte_symbols = bytes_to_unicode()
    vocab = {byte_symbols[b]: b for b in range(256)}
    learned = _learn_merges(corpus, merges) if corpus is not None and merges > 0 else []
    if learned:  # the added tokens keep ids 256-260; merged symbols follow, in merge order
        vocab.update({content: 256 + i for i, (content, _) in enumerate(ADDED_TOKENS)})
        for left, right in learned:  # two merges may spell one symbol: it keeps its first id
            vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=learned))
    backend.normalizer = normalizers.NFC()
    if learned:  # exactly Qwen2's pre-tokenizer, which transformers 5 rebuilds for any qwen2 folder
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=PAD_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


# Qwen2's pre-tokenizer split (transformers' `models/qwen2/tokenization_qwen2.py`, PRETOKENIZE_REGEX).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _learn_merges(corpus: Iterable[str], merges: int) -> list[tuple[str, str]]:
    """BPE merges learned from `corpus` by the `tokenizers` trainer, behind Qwen2's pre-tokenizer; the
    text is cut at the added tokens first (the trainer does not), so that no merge spans one."""
    byte_symbols = bytes_to_unicode()
    scratch = Tokenizer(models.BPE())
    scratch.normalizer = normalizers.NFC()
    scratch.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=[byte_symbols[b] for b in range(256)],
        special_tokens=[],
    )
    added = re.compile("|".join(re.escape(content) for content, _ in ADDED_TOKENS))
    scratch.train_from_iterator((piece for text in corpus for piece in added.split(text)), trainer=trainer)
    learned = json.loads(scratch.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned][:merges]


def build_tiny_model(
    path: Path | str,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = DEFAULT_NUM_HEADS,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = MAX_POSITIONS,
    vocab_corpus: Iterable[str] | None = None,
    merges: int = 0,
) -> Path:
    """Write a randomly initialised tiny Qwen2 model and its tokenizer to `path`; return `path`.

    `num_kv_heads` defaults to `num_heads` (no grouped-query attention), `intermediate_size` to
    `4 * hidden_size`. The default head width, `hidden_size / num_heads` = 32, is the smallest vLLM's CPU
    attention serves (`VLLM_CPU_HEAD_SIZES`); a narrower one passes vLLM's `/health` and then kills its
    engine on the first request. `vocab_corpus` and `merges`: a tokenizer with learned merges (`build_tokenizer`). The same arguments give byte-identical files. `path` is created if missing and
    must be empty, so a folder is never a mix of two builds. Raises `FileExistsError` otherwise.
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_corpus, merges)
    ids = {content: tokenizer.convert_tokens_to_ids(content) for content, _ in ADDED_TOKENS}

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG state alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[PAD_TOKEN], eos_token_id=[ids[IM_END], ids[PAD_TOKEN]], pad_token_id=ids[PAD_TOKEN]
    )
    model.save_pretrained(path)
    _save_tokenizer(tokenizer, path)
    return path


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json in the layout that both
    transformers 4 and 5 read (see the module docstring)."""
    tokenizer.backend_tokenizer.save(str(path / "tokenizer.json"), pretty=True)
    special = {"bos_token": PAD_TOKEN, "eos_token": IM_END, "pad_token": PAD_TOKEN}
    added = {
        str(tokenizer.convert_tokens_to_ids(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": is_special,
        }
        for content, is_special in ADDED_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **special,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": tokenizer.model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", special)


def _write_json(file: Path, value: dict) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
