"""The deployment layout of docker-compose.yml, checked statically: agents reach the agent port and nothing
else, and compose refuses to start the gateway without its secrets."""

from __future__ import annotations

import re

import pytest
from test_compose import SERVICES

from gateway import GatewaySettings
from rlgate.cli import GatewayCommand

SECRETS = ("RLGATE_OPERATOR_TOKEN", "RLGATE_WEBHOOK_SECRET", "RLGATE_ROLLOUT_KEY_SECRET")


def gateway_settings(monkeypatch: pytest.MonkeyPatch, secrets: dict[str, str]) -> GatewaySettings:
    spec = SERVICES["gateway"]
    for key, value in spec["environment"].items():
        if key not in SECRETS:
            monkeypatch.setenv(key, str(value))
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    command = GatewayCommand(_cli_parse_args=spec["command"][2:])
    return GatewaySettings.model_validate(command.model_dump())


def test_only_the_agent_port_is_published(monkeypatch):
    settings = gateway_settings(monkeypatch, {name: name.lower() + "-" + "0" * 32 for name in SECRETS})
    assert settings.control_port is not None and settings.control_port != settings.port
    assert SERVICES["gateway"]["ports"] == [f"{settings.port}:{settings.port}"]
    assert str(settings.control_port) not in " ".join(SERVICES["gateway"]["ports"])
    for name, spec in SERVICES.items():
        assert name == "gateway" or "ports" not in spec, f"{name} publishes a port"
    # the health check asks the control port (the agent port's /healthz only says the process is up)
    healthcheck = " ".join(SERVICES["gateway"]["healthcheck"]["test"])
    assert f"localhost:{settings.control_port}/healthz" in healthcheck
    assert settings.require_rollout_keys
    settings.check_layout()  # with its secrets, the layout is one the gateway accepts


def test_compose_refuses_to_start_without_the_secrets(monkeypatch):
    environment = SERVICES["gateway"]["environment"]
    for name in SECRETS:
        assert re.fullmatch(rf"\$\{{{name}:\?[^}}]+\}}", environment[name]), environment[name]
    # and the gateway itself refuses the same layout without an operator token
    settings = gateway_settings(monkeypatch, {"RLGATE_ROLLOUT_KEY_SECRET": "k" * 32})
    settings.check_layout()  # the control port alone is a valid boundary...
    settings = settings.model_copy(update={"control_port": None})
    with pytest.raises(ValueError, match="operator surface would be open"):
        settings.check_layout()  # ...without it, agents with keys would reach the operator surface
