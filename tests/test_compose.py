"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine here): every service's
command is a real `rlgate` subcommand whose flags parse, every RLGATE_* variable is a setting of that
service, the learner writes adapters where vLLM reads them, GPUs are reserved, start order is healthy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic_settings import BaseSettings

from conftest import ROOT
from rlgate.cli import GatewayCommand, LearnerCommand, WorkerCommand

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ENV_FILE = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
COMMANDS: dict[str, type[BaseSettings]] = {"gateway": GatewayCommand, "worker": WorkerCommand,
                                           "learner": LearnerCommand}


def expand(value: str) -> str:
    """${VAR} and ${VAR:-default} as compose expands them from .env."""
    def one(match: re.Match) -> str:
        name, _, default = match.group(1).partition(":-")
        return ENV_FILE.get(name) or default
    return re.sub(r"\$\{([^}]+)\}", one, value)


def test_the_services_and_their_start_order():
    assert set(SERVICES) == {"redis", "vllm", "gateway", "worker", "learner"}
    for name in ("gateway", "learner"):
        assert SERVICES[name]["depends_on"] == {"redis": {"condition": "service_healthy"},
                                                "vllm": {"condition": "service_healthy"}}
    assert SERVICES["worker"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    for name in ("redis", "vllm", "gateway"):
        assert SERVICES[name]["healthcheck"]["test"][0] == "CMD"
    # Redis persists the episodes (AOF on a volume)
    assert "--appendonly" in SERVICES["redis"]["command"] and "redis-data:/data" in SERVICES["redis"]["volumes"]


@pytest.mark.parametrize("service", sorted(COMMANDS))
def test_each_command_is_an_rlgate_subcommand_whose_flags_and_env_parse(service: str, monkeypatch):
    spec = SERVICES[service]
    command = spec["command"]
    assert command[:2] == ["rlgate", service]
    cls = COMMANDS[service]
    environment = {k: expand(str(v)) for k, v in spec["environment"].items()}
    fields: set[str] = set()
    for name, field in cls.model_fields.items():
        fields |= {name.upper(), (field.alias or name).upper()}
    prefixes = {"learner": "RLGATE_LEARNER_"}.get(service, "RLGATE_")
    for key in environment:
        if key.startswith("RLGATE_"):
            assert key.startswith(prefixes) and key[len(prefixes):] in fields, f"{service}: unknown setting {key}"
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    settings = cls(_cli_parse_args=command[2:])  # parses flags and env exactly as the CLI does
    if service == "gateway":
        assert settings.upstream_url == "http://vllm:8000/v1" and settings.host == "0.0.0.0"
        assert settings.redis_url == "redis://redis:6379/0"
    if service == "learner":
        assert settings.resume and settings.device == "cuda" and settings.inference_urls == ["http://vllm:8000"]
        assert str(settings.model) == ENV_FILE["POLICY_MODEL"]
        assert settings.served_model_name == ENV_FILE["SERVED_MODEL_NAME"]


def test_vllm_serves_runtime_lora_and_hermes_tools_on_a_gpu():
    vllm = SERVICES["vllm"]
    assert expand(vllm["image"]).startswith("vllm/vllm-openai:")
    command = [expand(c) for c in vllm["command"]]
    for flag in ("--enable-lora", "--enable-auto-tool-choice"):
        assert flag in command
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    # the learner's importance correction needs the log-probs of the distribution sampled from, and
    # vLLM's default is raw_logprobs
    learner_mode = SERVICES["learner"]["environment"].get("RLGATE_LEARNER_LOGPROBS_MODE", "processed_logprobs")
    assert command[command.index("--logprobs-mode") + 1] == learner_mode == "processed_logprobs"
    assert command[command.index("--served-model-name") + 1] == ENV_FILE["SERVED_MODEL_NAME"]
    assert command[command.index("--model") + 1] == ENV_FILE["POLICY_MODEL"]
    assert int(command[command.index("--max-lora-rank") + 1]) >= int(SERVICES["learner"]["environment"]
                                                                       ["RLGATE_LEARNER_LORA_RANK"])
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for name in ("vllm", "learner"):
        [device] = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def mounts(service: str) -> dict[str, str]:
    return {spec.split(":")[1]: spec.split(":")[0] for spec in SERVICES[service]["volumes"]}


def test_the_learner_writes_adapters_where_vllm_reads_them():
    output_dir = Path(SERVICES["learner"]["environment"]["RLGATE_LEARNER_OUTPUT_DIR"])
    learner, vllm = mounts("learner"), mounts("vllm")
    [(target, volume)] = [(t, v) for t, v in learner.items() if output_dir.is_relative_to(t)]
    assert vllm.get(target) == volume and volume in COMPOSE["volumes"]  # same volume, same path
    # the learner loads the model vLLM downloaded: the same Hugging Face cache
    assert learner["/root/.cache/huggingface"] == vllm["/root/.cache/huggingface"]


def test_the_images_are_targets_of_the_dockerfile():
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    for name in ("gateway", "worker", "learner"):
        assert SERVICES[name]["build"]["target"] in targets
    # the learner's image installs OpenRLHF the way the learner expects (without vLLM and flash-attn)
    assert "pip install --no-deps openrlhf==0.11.2" in dockerfile
    copied = set(re.findall(r"^COPY (\w+) ", dockerfile, re.M))
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= copied | {"tests"}, packages - copied
