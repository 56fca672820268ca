"""The `rlgate` command as a user meets it, run as real processes against the real Redis and a real gateway:
help that names each option's variables, --version, one environment prefix for shared settings, one line
and exit code 2 for every ordinary mistake, and `rlgate rollouts list/show` over GET /rollouts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import redis
from conftest import REDIS_URL, ROOT, Proc, free_port, rlgate, start_gateway

MODEL = "fake-model"


def dead_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def one_line_mistake(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, one line on stderr that names what to do, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- help, version, flags, environment ----


@pytest.mark.parametrize(
    "command",
    [
        "gateway",
        "worker",
        "reward",
        "export",
        "learner",
        "demo",
        "serve",
        "make-tiny-model",
        "rollouts list",
        "rollouts show",
    ],
)
def test_help_shows_placeholders_not_python_types(command: str):
    result = rlgate(*command.split(), "--help")
    assert result.returncode == 0, result.stderr
    for python in ("SecretStr", "list[", "dict[", ",null}", "default factory", "<lambda>"):
        assert python not in result.stdout, (command, python)
    placeholders = set(re.findall(r"--[a-z-]+ ([^\s\]]+)", result.stdout))
    assert placeholders, result.stdout
    assert not placeholders & {"str", "float", "int", "bool", "Path", "SecretStr"}, (command, placeholders)


def test_help_names_each_options_variables():
    learner = rlgate("learner", "--help").stdout
    assert "[env: RLGATE_LEARNER_REDIS_URL | RLGATE_REDIS_URL]" in " ".join(learner.split())
    assert "RLGATE_LEARNER_INFERENCE_API_KEY | RLGATE_INFERENCE_API_KEY" in " ".join(learner.split())
    assert "--resume, --no-resume" in learner and "--inference-api-key SECRET" in learner
    gateway = " ".join(rlgate("gateway", "--help").stdout.split())
    assert "--operator-token SECRET" in gateway and "[env: RLGATE_OPERATOR_TOKEN]" in gateway
    assert "[env: RLGATE_UPSTREAM_API_KEY | RLGATE_INFERENCE_API_KEY]" in gateway
    assert "--air, --no-air" in gateway
    serve = " ".join(rlgate("serve", "--help").stdout.split())
    assert (
        "--dev-mode, --no-dev-mode" in serve
        and "[env: RLGATE_SERVE_API_KEY | RLGATE_INFERENCE_API_KEY]" in serve
    )
    # a command read from flags alone names no variable
    assert "[env:" not in rlgate("make-tiny-model", "--help").stdout


def test_worker_help_lists_only_what_a_reward_job_reads():
    worker = rlgate("worker", "--help").stdout
    for gateway_only in (
        "--webhook-secret",
        "--agent-rewards",
        "--reward-job-retries",
        "--sweep-interval-s",
        "--expired-fill-reward",
        "--upstream-url",
    ):
        assert gateway_only not in worker
    for own in ("--judge-model", "--reward-data-dir", "--burst, --no-burst", "--fork, --no-fork"):
        assert own in worker


def test_version_comes_from_the_package_metadata():
    result = rlgate("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"rlgate {importlib.metadata.version('rlgate')}"


def test_shared_redis_url_reaches_the_learner_and_its_own_name_wins(monkeypatch):
    shared, own = dead_redis(), dead_redis()
    # the learner checks Redis before anything else: its one-line error names the URL it was given
    one_line_mistake(rlgate("learner", env={"RLGATE_REDIS_URL": shared}), shared.split("//")[1].split("/")[0])
    line = one_line_mistake(
        rlgate("learner", env={"RLGATE_REDIS_URL": shared, "RLGATE_LEARNER_REDIS_URL": own})
    )
    assert own.split("//")[1].split("/")[0] in line and shared.split("//")[1].split("/")[0] not in line
    # and the flag wins over both
    flag = dead_redis()
    line = one_line_mistake(rlgate("learner", "--redis-url", flag, env={"RLGATE_LEARNER_REDIS_URL": own}))
    assert flag.split("//")[1].split("/")[0] in line
    # in the settings classes themselves
    from gateway import GatewaySettings
    from learner.settings import LearnerSettings
    from reward_hooks.settings import RewardSettings

    monkeypatch.setenv("RLGATE_REDIS_URL", "redis://shared:1/0")
    monkeypatch.setenv("RLGATE_KEY_PREFIX", "tenant")
    monkeypatch.setenv("RLGATE_INFERENCE_API_KEY", "k" * 20)
    learner = LearnerSettings()
    assert (learner.redis_url, learner.key_prefix) == ("redis://shared:1/0", "tenant")
    assert learner.inference_api_key.get_secret_value() == "k" * 20
    assert GatewaySettings().upstream_api_key.get_secret_value() == "k" * 20
    assert RewardSettings().key_prefix == "tenant"
    monkeypatch.setenv("RLGATE_LEARNER_KEY_PREFIX", "own")
    assert LearnerSettings().key_prefix == "own"


def test_booleans_given_a_value_still_work(redis_client: redis.Redis):
    from rlgate.cli import _flag_values

    assert _flag_values(
        ["serve", "--dev-mode", "true", "--allow-runtime-lora-updating=false", "--port", "1"]
    ) == ["serve", "--dev-mode", "--no-allow-runtime-lora-updating", "--port", "1"]
    assert _flag_values(["learner", "--resume", "false", "--model", "m"]) == [
        "learner",
        "--no-resume",
        "--model",
        "m",
    ]
    assert _flag_values(["learner", "--resume", "--model", "m"]) == ["learner", "--resume", "--model", "m"]
    # a real process: an empty queue, so --burst returns at once; the old and the new spelling
    for burst in (["--burst", "true"], ["--burst"]):
        result = rlgate("worker", *burst, "--no-fork", env={"RLGATE_REDIS_URL": REDIS_URL}, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]


# ---- one line and exit code 2 for each ordinary mistake ----


def test_reward_without_a_reachable_gateway():
    url = f"http://127.0.0.1:{free_port()}"
    one_line_mistake(
        rlgate("reward", "r1", "1.0", "--gateway-url", url), "cannot reach the gateway", url, "--gateway-url"
    )


def test_redis_down_at_every_command_that_needs_it(tmp_path, fake_vllm: Proc):
    url = dead_redis()
    for args in (
        ["export", str(tmp_path / "out.jsonl"), "--redis-url", url],
        ["worker", "--burst"],
        ["learner"],
    ):
        one_line_mistake(
            rlgate(*args, env={"RLGATE_REDIS_URL": url}, timeout=60), "start Redis", "RLGATE_REDIS_URL"
        )
    # the gateway is built to run without Redis (503s, or on_store_error=pass): it starts and says so
    proc = start_gateway(
        tmp_path,
        fake_vllm.url,
        redis_url=url,
        wait_healthy=False,
        redis_timeout_s="0.5",
        log_format="console",
    )
    try:
        deadline = time.monotonic() + 30
        while "rlgate gateway: warning:" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        warning = next(
            line for line in proc.log().splitlines() if line.startswith("rlgate gateway: warning:")
        )
        assert "503" in warning and "RLGATE_REDIS_URL" in warning and "Traceback" not in proc.log()
        assert proc.process.poll() is None
    finally:
        proc.kill()


def test_a_redis_url_naming_a_cluster_node_is_one_line_that_names_redis_cluster(tmp_path, fake_vllm: Proc):
    """A redis:// URL to a node of a Redis Cluster connected, pinged, then failed each call with MOVED or
    CLUSTERDOWN, told to agents as a bare Redis error. Now every command that uses Redis refuses it at start
    and names redis+cluster://."""
    from redis_servers import cluster_ports, private_redis

    [port] = cluster_ports(1)  # its bus port (port + 10000) free too
    with private_redis(
        port, "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")
    ):
        url = f"redis://127.0.0.1:{port}/0"
        env = {"RLGATE_REDIS_URL": url, "RLGATE_UPSTREAM_URL": fake_vllm.url}
        for args in (["gateway"], ["worker", "--burst"], ["learner"]):
            one_line_mistake(rlgate(*args, env=env, timeout=60), "Redis Cluster", "redis+cluster://")


def test_a_redis_that_refuses_info_still_serves_the_gateway(tmp_path, fake_vllm: Proc):
    """Some managed Redis services forbid or rename INFO: the cluster-node check at start and the memory
    watch then know nothing, and the gateway starts and records as before (no memory hold)."""
    from redis_servers import private_redis

    port = free_port()
    with private_redis(port, "--rename-command", "INFO", ""):
        proc = start_gateway(tmp_path, fake_vllm.url, redis_url=f"redis://127.0.0.1:{port}/0")
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            answer = httpx.post(f"{proc.url}/rollouts/{uuid.uuid4().hex}/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            health = httpx.get(f"{proc.url}/healthz", timeout=10).json()
            assert health["holding_new_rollouts"] is False and health["redis_memory"]["max"] == 0, health
        finally:
            proc.kill()
        assert "Traceback" not in proc.log()


def test_a_bad_setting_names_the_option_not_the_value():
    one_line_mistake(
        rlgate("learner", "--tasks-per-step", "many"),
        "--tasks-per-step",
        "RLGATE_LEARNER_TASKS_PER_STEP",
        "valid integer",
    )
    line = one_line_mistake(
        rlgate("learner", env={"RLGATE_LEARNER_ROLLOUTS_PER_TASK": "0"}), "--rollouts-per-task"
    )
    assert "greater than or equal to 1" in line
    # a secret that is refused is not echoed
    secret = "short-secret"
    line = one_line_mistake(
        rlgate("gateway", env={"RLGATE_OPERATOR_TOKEN": secret, "RLGATE_REDIS_URL": REDIS_URL}),
        "operator_token must be at least 16 characters",
    )
    assert secret not in line
    one_line_mistake(rlgate("learner", "--no-such-option"), "unrecognized arguments", "--help")


def test_export_takes_dates_and_says_which_format_it_wants(tmp_path, redis_client: redis.Redis):
    one_line_mistake(
        rlgate(
            "export", str(tmp_path / "a.jsonl"), "--since", "2026-11-31", env={"RLGATE_REDIS_URL": REDIS_URL}
        ),
        "--since",
        "2026-11-30",
        "unix seconds",
    )
    for since in ("2026-11-30", "2026-11-30T12:00:00+02:00", "1780000000"):
        result = rlgate(
            "export", str(tmp_path / "b.jsonl"), "--since", since, env={"RLGATE_REDIS_URL": REDIS_URL}
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["rows"] == 0


def test_an_empty_export_says_what_it_looked_for(tmp_path, gateway: Proc, redis_client: redis.Redis):
    out = str(tmp_path / "e.jsonl")
    result = rlgate("export", out, env={"RLGATE_REDIS_URL": REDIS_URL})
    assert result.returncode == 0 and json.loads(result.stdout)["rows"] == 0
    (line,) = result.stderr.strip().splitlines()
    assert "no rollouts under key prefix 'rlgate'" in line and "RLGATE_REDIS_URL" in line
    httpx.post(f"{gateway.url}/rollouts", json={"task_id": "t"}).raise_for_status()
    result = rlgate("export", out, "--task", "t", env={"RLGATE_REDIS_URL": REDIS_URL})
    (line,) = result.stderr.strip().splitlines()
    assert "nothing matched status closed or consumed, task t" in line and "holds 1 open" in line
    assert "once a reward closes it" in line


def test_a_missing_extra_says_what_to_install(tmp_path):
    fake = tmp_path / "site"
    for name in ("torch", "openai"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n"
        )
    env = {"PYTHONPATH": str(fake), "RLGATE_REDIS_URL": REDIS_URL}
    one_line_mistake(rlgate("serve", "--model", str(tmp_path), env=env), "pip install 'rlgate[serve]'")
    one_line_mistake(rlgate("make-tiny-model", str(tmp_path / "m"), env=env), "pip install 'rlgate[serve]'")
    one_line_mistake(rlgate("learner", env=env), "pip install 'rlgate[learner]'")
    one_line_mistake(rlgate("demo", "--workdir", str(tmp_path / "d"), env=env), "pip install 'rlgate[demo]'")


def test_debug_shows_the_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    for result in (
        rlgate("reward", "r1", "1.0", "--gateway-url", url, "--debug"),
        rlgate("reward", "r1", "1.0", "--gateway-url", url, env={"RLGATE_DEBUG": "1"}),
    ):
        assert result.returncode != 0 and "Traceback" in result.stderr and "UsageError" in result.stderr


# ---- rollouts list / show over GET /rollouts ----


def chat(gateway: Proc, task: str, rid: str) -> None:
    response = httpx.post(
        f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    response.raise_for_status()


def listing(gateway: Proc, **params) -> dict:
    response = httpx.get(f"{gateway.url}/rollouts", params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def walk(gateway: Proc, **params) -> tuple[list[dict], int]:
    rows, pages, cursor = [], 0, None
    while True:
        page = listing(gateway, **params, **({"cursor": cursor} if cursor else {}))
        rows += page["rollouts"]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            return rows, pages


def test_rollouts_are_listed_newest_first_page_by_page_and_filtered(gateway: Proc, redis_client: redis.Redis):
    made = []
    for i in range(7):  # created by POST /rollouts and by a first call, two tasks
        rid = f"r{i}-{uuid.uuid4().hex[:6]}"
        task = "even" if i % 2 == 0 else "odd"
        if i < 4:
            httpx.post(
                f"{gateway.url}/rollouts", json={"rollout_id": rid, "task_id": task}
            ).raise_for_status()
        else:
            chat(gateway, task, rid)
        made.append((rid, task))
        time.sleep(0.002)
    httpx.post(f"{gateway.url}/rollouts/{made[4][0]}/reward", json={"reward": 0.5}).raise_for_status()
    newest_first = [rid for rid, _ in reversed(made)]

    rows, pages = walk(gateway, limit=3)
    assert [r["rollout_id"] for r in rows] == newest_first and pages == 3
    by_id = {r["rollout_id"]: r for r in rows}
    assert by_id[made[4][0]]["status"] == "closed" and by_id[made[4][0]]["reward"] == 0.5
    assert by_id[made[4][0]]["calls"] == 1 and by_id[made[0][0]]["calls"] == 0

    # a filtered page may hold fewer than limit; the cursor goes on to the end
    first = listing(gateway, task_id="odd", limit=2)
    assert len(first["rollouts"]) == 1 and first["next_cursor"] is not None
    rows, _ = walk(gateway, task_id="odd", limit=2)
    assert [r["rollout_id"] for r in rows] == [rid for rid, task in reversed(made) if task == "odd"]
    rows, _ = walk(gateway, status="closed", limit=1000)
    assert [r["rollout_id"] for r in rows] == [made[4][0]]
    # since/until on the creation time
    created = {r["rollout_id"]: r["created_at"] for r in walk(gateway, limit=100)[0]}
    rows, _ = walk(gateway, since=created[made[5][0]])
    assert [r["rollout_id"] for r in rows] == [made[6][0], made[5][0]]

    # bad requests are 4xx, never 5xx
    assert httpx.get(f"{gateway.url}/rollouts", params={"cursor": "nope"}).status_code == 400
    assert httpx.get(f"{gateway.url}/rollouts", params={"limit": 1001}).status_code == 422
    assert httpx.get(f"{gateway.url}/rollouts", params={"status": "weird"}).status_code == 422


def test_paging_through_rollouts_created_at_the_same_instant(gateway: Proc, redis_client: redis.Redis):
    rids = [f"tie-{i}" for i in range(5)]
    for rid in rids:
        httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": rid}).raise_for_status()
    redis_client.zadd("rlgate:rollouts", dict.fromkeys(rids, 1000.0))
    for limit in (1, 2, 3):
        rows, _ = walk(gateway, limit=limit)
        assert sorted(r["rollout_id"] for r in rows) == rids and len(rows) == 5, limit


def test_the_listing_index_is_bounded(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(tmp_path, fake_vllm.url, rollout_index_max="3")
    try:
        for i in range(5):
            httpx.post(f"{proc.url}/rollouts", json={"rollout_id": f"b{i}"}).raise_for_status()
        chat(proc, "t", "b5")
        assert redis_client.zcard("rlgate:rollouts") == 3
        assert [r["rollout_id"] for r in walk(proc, limit=10)[0]] == ["b5", "b4", "b3"]
        assert httpx.get(f"{proc.url}/rollouts/b0").status_code == 200  # still readable by id
    finally:
        proc.kill()


def test_rollouts_list_and_show_commands(gateway: Proc, redis_client: redis.Redis):
    for i in range(5):
        chat(gateway, "calc" if i < 3 else "other", f"cli-{i}")
    env = {"RLGATE_GATEWAY_URL": gateway.url}
    table = rlgate("rollouts", "list", "--task", "calc", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["ROLLOUT", "TASK", "STATUS"]
    assert [line.split()[0] for line in lines[1:]] == ["cli-2", "cli-1", "cli-0"]
    # --limit across pages, and where to go on
    result = rlgate("rollouts", "list", "--limit", "2", "--output", "jsonl", env=env)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["rollout_id"] for r in rows] == ["cli-4", "cli-3"]
    more = result.stderr.strip()
    assert more.startswith("more: rlgate rollouts list --cursor ")
    cursor = more.split("--cursor ")[1].split()[0]
    rest = rlgate("rollouts", "list", "--cursor", cursor, "--output", "jsonl", env=env)
    assert [json.loads(line)["rollout_id"] for line in rest.stdout.splitlines()] == [
        "cli-2",
        "cli-1",
        "cli-0",
    ]
    assert rlgate("rollouts", "list", "--status", "closed", env=env).stderr.startswith("no rollouts matched")
    one_line_mistake(rlgate("rollouts", "list", "--since", "yesterday", env=env), "--since", "unix seconds")

    shown = rlgate("rollouts", "show", "cli-1", env=env)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["rollout_id"] == "cli-1" and view["task_id"] == "calc" and len(view["calls"]) == 1
    assert view["calls"][0]["completion_token_ids"]
    assert json.loads(rlgate("rollouts", "show", "cli-1", "--no-calls", env=env).stdout)["calls"] == []
    one_line_mistake(rlgate("rollouts", "show", "nope", env=env), "HTTP 404", "no rollout 'nope'")


def test_rollouts_commands_use_the_operator_token(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    token = "operator-token-" + uuid.uuid4().hex
    proc = start_gateway(tmp_path, fake_vllm.url, operator_token=token)
    try:
        one_line_mistake(
            rlgate("rollouts", "list", "--gateway-url", proc.url), "HTTP 401", "RLGATE_OPERATOR_TOKEN"
        )
        result = rlgate("rollouts", "list", "--gateway-url", proc.url, env={"RLGATE_OPERATOR_TOKEN": token})
        assert result.returncode == 0 and result.stdout.startswith("ROLLOUT"), result.stderr
    finally:
        proc.kill()


def test_list_rollouts_reads_are_bounded():
    import asyncio

    from rlgate.episodes import EpisodeStore
    from rlgate.episodes.store import LIST_MAX

    async def go() -> None:
        store = EpisodeStore.from_url(REDIS_URL)
        try:
            for bad in (0, LIST_MAX + 1):
                with pytest.raises(ValueError, match="limit"):
                    await store.list_rollouts(limit=bad)
        finally:
            await store.aclose()

    asyncio.run(go())


def test_a_missing_model_folder_is_one_line_not_a_hub_lookup(tmp_path):
    """A model that looks like a path and is not a folder is a mistake, said at once; only `org/name`
    (nothing at that path) is taken as a Hugging Face Hub id."""
    for model in ("./models/tiny", str(tmp_path / "missing"), "runs/tiny/model", "~/nope"):
        result = rlgate("learner", "--model", model)
        assert result.returncode == 2, (model, result.stderr)
        assert result.stderr.strip().count("\n") == 0 and "no model folder" in result.stderr, result.stderr


def _start_follower(out, *args: str) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "export", str(out), "--follow", *args],
        env={**environ, "RLGATE_REDIS_URL": REDIS_URL},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline()
    assert json.loads(first)["group"] == "exporters", first + proc.stderr.read()
    return proc


def _exported(out, strict: bool = True) -> list[tuple[str, int]]:
    """The (rollout, call index) of each row; `strict=False` skips a line that does not parse (yet)."""
    rows = []
    for line in out.read_text().splitlines() if out.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            if strict:
                raise
            continue
        rows.append((row["rollout_id"], row["index"]))
    return rows


def test_export_follow_appends_each_closed_episode_once(tmp_path, gateway: Proc, redis_client: redis.Redis):
    from test_reward_hooks import agent_call

    out = tmp_path / "live.jsonl"
    follower = _start_follower(out)
    try:
        first = [f"f{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
        for rid in first:
            agent_call(gateway, rid)
            agent_call(gateway, rid)
            httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": 1}).raise_for_status()
        agent_call(gateway, f"open-{uuid.uuid4().hex[:6]}")  # not closed: not exported

        def exporters() -> dict:
            (group,) = [g for g in redis_client.xinfo_groups("rlgate:episodes") if g["name"] == b"exporters"]
            return group

        deadline = time.monotonic() + 30
        while (len(_exported(out)) < 6 or exporters()["pending"]) and time.monotonic() < deadline:
            time.sleep(0.1)  # rows are written, fsynced, then acknowledged
        assert sorted(_exported(out)) == sorted((rid, i) for rid in first for i in (0, 1))
        assert exporters()["pending"] == 0 and exporters()["lag"] == 0
        follower.terminate()  # SIGTERM: finishes, says what it did
        stdout, stderr = follower.communicate(timeout=20)
        assert follower.returncode == 0, stderr
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert (summary["episodes"], summary["rows"], summary["gone"]) == (3, 6, 0)
        # closed while no exporter ran: the group remembers where it was, the next run exports only those
        later = f"later-{uuid.uuid4().hex[:6]}"
        agent_call(gateway, later)
        httpx.post(f"{gateway.url}/rollouts/{later}/reward", json={"reward": 0}).raise_for_status()
        with out.open("ab") as f:
            f.write(b'{"rollout_id": "half-written by a crash')  # no newline: cut off on restart
        follower = _start_follower(out)
        deadline = time.monotonic() + 30
        while len(_exported(out, strict=False)) < 7 and time.monotonic() < deadline:
            time.sleep(0.1)
        follower.terminate()
        stdout, _ = follower.communicate(timeout=20)
        assert json.loads(stdout.strip().splitlines()[-1])["episodes"] == 1
        assert sorted(_exported(out)) == sorted([(rid, i) for rid in first for i in (0, 1)] + [(later, 0)])
        # the rows are those of the one-shot export
        batch = tmp_path / "batch.jsonl"
        assert rlgate("export", str(batch), env={"RLGATE_REDIS_URL": REDIS_URL}).returncode == 0
        assert sorted(out.read_text().splitlines()) == sorted(batch.read_text().splitlines())
        one_line_mistake(
            rlgate(
                "export", str(batch), "--follow", "--format", "parquet", env={"RLGATE_REDIS_URL": REDIS_URL}
            ),
            "--follow appends JSONL",
        )
    finally:
        if follower.poll() is None:
            follower.kill()
