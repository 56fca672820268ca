"""The tiny model built in code: a real Hugging Face folder, loaded back with transformers (and
peft when installed), its byte-level tokenizer and its Hermes-style chat template."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlgate.inference import build_tiny_model, build_tokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
SPECIAL_IDS = {
    "<|endoftext|>": 256,
    "<|im_start|>": 257,
    "<|im_end|>": 258,
    "<tool_call>": 259,
    "</tool_call>": 260,
}
VOCAB = 261


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


def digests(path: Path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in FILES}


# --- the folder and the model ----------------------------------------------------------------------


def test_folder_holds_a_standard_qwen2_checkpoint(model_dir: Path, model) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == FILES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (VOCAB, 64, 2)
    # head width 64 / 2 = 32: the smallest vLLM's CPU attention serves
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 2)
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 2048
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (256, 258, 256)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [258, 256]
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (VOCAB, 64)
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}
    assert "lm_head.weight" not in names  # tied to the embedding, as Qwen2.5's small models are
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32


def test_forward_gives_logits_over_the_vocabulary(model, tokenizer) -> None:
    ids = tokenizer("What is 17 + 25?", return_tensors="pt").input_ids
    assert ids.shape == (1, 16)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 16, VOCAB)
    assert torch.isfinite(logits).all()


def test_greedy_generate_continues_with_the_argmax_token(model, tokenizer) -> None:
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt").input_ids
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        again = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 6)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    assert int(out[0, ids.shape[1]]) == first
    assert torch.equal(out, again)
    assert int(out.max()) < VOCAB


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    first = digests(build_tiny_model(tmp_path / "a", seed=7))
    second = digests(build_tiny_model(tmp_path / "b", seed=7))
    other = digests(build_tiny_model(tmp_path / "c", seed=8))
    script = (
        f"from rlgate.inference import build_tiny_model; build_tiny_model({str(tmp_path / 'd')!r}, seed=7)"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parent.parent)
    assert first == second == digests(tmp_path / "d")  # also across processes (no hash-order effects)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone


def test_size_arguments_shape_the_model(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (32, 1, 128)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    # embedding (tied) + layer (q, k, v with bias; o; gate, up, down; 2 norms) + final norm
    layer = (32 * 32 + 32) + 2 * (32 * 16 + 16) + 32 * 32 + 3 * 32 * 128 + 2 * 32
    assert sum(p.numel() for p in model.parameters()) == VOCAB * 32 + layer + 32 == 23_872


def test_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


# --- the tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "line one\nline two\r\n\ttabbed  double  spaces \n\n",
        "emoji 👋🏽 family 👨‍👩‍👧 flags 🇫🇷",
        "日本語のテキスト, Ελληνικά, עברית, café",
        " leading space and trailing ",
        '{"name": "add", "arguments": {"a": 2}}',
        "\x00\x07 control bytes \x7f",
    ],
)
def test_text_round_trips_byte_for_byte(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))  # one token per UTF-8 byte, id = byte value, no BOS
    assert tokenizer.decode(ids) == text


def test_text_is_nfc_normalized_like_qwen(tokenizer) -> None:
    decomposed = "cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) == "café"
    assert tokenizer.decode(tokenizer.encode(decomposed)) == "café"


def test_special_tokens_are_single_ids(tokenizer) -> None:
    assert len(tokenizer) == VOCAB
    for text, token_id in SPECIAL_IDS.items():
        assert tokenizer.encode(text) == [token_id]
        assert tokenizer.convert_ids_to_tokens(token_id) == text
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [257, 117, 115, 101, 114, 10, 104, 105, 258]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (258, 256, 256)


def test_tool_call_tags_survive_skip_special_tokens(tokenizer) -> None:
    ids = [257, 104, 259, 123, 125, 260, 258, 256]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "h<tool_call>{}</tool_call>"
    assert tokenizer.decode(ids) == "<|im_start|>h<tool_call>{}</tool_call><|im_end|><|endoftext|>"


def test_every_loader_gives_the_same_ids(model_dir: Path, tokenizer) -> None:
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "<|im_start|>user\ncafe\u0301 👋 <tool_call>{}</tool_call><|im_end|>\n"
    assert raw.encode(text).ids == tokenizer.encode(text) == build_tokenizer().encode(text)


# --- the chat template -----------------------------------------------------------------------------

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def tool_conversation(arguments: str | dict) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


TOOL_CONVERSATION = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, '
    '"required": ["a", "b"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n2+3?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize("arguments", ['{"a": 2, "b": 3}', {"a": 2, "b": 3}], ids=["json-string", "mapping"])
def test_tool_conversation_renders_hermes_style(tokenizer, arguments: str | dict) -> None:
    rendered = tokenizer.apply_chat_template(
        tool_conversation(arguments), tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert rendered == TOOL_CONVERSATION


def test_plain_chat_and_generation_prompt(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]


def test_content_beside_tool_calls_and_grouped_tool_results(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"type": "function", "function": {"name": "g", "arguments": '{"x": "ü"}'}},
            ],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\nTwo calls.\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"x": "ü"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\ndone<|im_end|>\n"
    )


# --- peft --------------------------------------------------------------------------------------------


def test_peft_wraps_it_with_lora(model_dir: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids = torch.tensor([[257, 117, 115, 101, 114, 10, 104, 105]])
    with torch.no_grad():
        before = base(ids).logits
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(base, config)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert trainable == 2 * 2 * (4 * 64 + 64 * 4)  # layers x (q, v) x (A + B)
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, before)  # B starts at zero
    wrapped.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 0


def test_a_tokenizer_with_learned_merges_reads_the_same_in_every_loader(tmp_path: Path) -> None:
    """Merges learned from a corpus (the calc-chat demo's base model): Qwen2's split, so transformers 5's
    rebuilt Qwen2Tokenizer, the raw tokenizers file and the in-memory builder give the same ids; bytes and
    added tokens keep their ids; frequent words become one token, digits stay one token each; the same
    corpus gives the same file."""
    corpus = [f"<|im_start|>user\nWhat is the function {n} + {n * 7}?<|im_end|>\n" for n in range(200)]
    path = build_tiny_model(tmp_path / "a", vocab_corpus=corpus, merges=64)
    again = build_tiny_model(tmp_path / "b", vocab_corpus=corpus, merges=64)
    assert (path / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    loaded = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    built = build_tokenizer(corpus, 64)
    assert type(loaded).__name__ == "Qwen2Tokenizer"  # transformers 5 rebuilt the pipeline
    assert VOCAB < len(loaded) <= VOCAB + 64
    assert AutoConfig.from_pretrained(path).vocab_size == len(loaded)
    assert sorted(loaded.get_vocab().values()) == list(range(len(loaded)))  # no id left out
    for text in [*corpus[:3], "What is 1234 * 56? café 👋 <tool_call>{}</tool_call>", " \n\n x  y"]:
        ids = loaded.encode(text)
        assert raw.encode(text).ids == ids == built.encode(text)
        assert loaded.decode(ids) == text
    assert loaded.encode(" function") == [loaded.convert_tokens_to_ids("Ġfunction")]
    assert [loaded.decode([i]) for i in loaded.encode("1234")] == ["1", "2", "3", "4"]
    for text, token_id in SPECIAL_IDS.items():
        assert loaded.encode(text) == [token_id]
    assert loaded.encode("\x00A") == [0, 65]
