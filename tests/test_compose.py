"""docker-compose.yml, Dockerfile and deploy/prometheus.yml checked against the code.

Docker cannot run here, so every service's command is parsed by the real CLI (`--help`
as a process, and click's own parser with the service's environment), and the ports,
env vars, Redis settings, GPU reservations, image stages and extras are cross-checked.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click
import pytest
import redis
import yaml
from helpers.processes import BATCHGATE, free_port

from batchgate.cli import main as batchgate_main
from scheduler_core.policy import LIMITS

ROOT = Path(__file__).resolve().parent.parent
INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`, recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.groups()
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")
    return INTERPOLATION.sub(one, value)


RAW = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
COMPOSE = interpolate(RAW, {})  # as `docker compose up` without a .env file
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
CONSUMERS = sorted(name for name in SERVICES if name.startswith("consumer"))
BATCHGATE_SERVICES = sorted(name for name, s in SERVICES.items()
                            if s.get("command", [None])[0] == "batchgate")


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def resolve(args: list[str]) -> tuple[click.Command, list[str], str]:
    """The click command an argv (without the program) runs, its own args, its path."""
    group: click.Command = batchgate_main
    path = "batchgate"
    with click.Context(batchgate_main) as ctx:
        while isinstance(group, click.Group) and args and not args[0].startswith("-"):
            sub = group.get_command(ctx, args[0])
            assert sub is not None, f"{path} has no subcommand {args[0]!r}"
            group, path, args = sub, f"{path} {args[0]}", args[1:]
    return group, args, path


def envvars(command: click.Command) -> set[str]:
    names: set[str] = set()
    for param in command.params:
        if isinstance(param.envvar, str):
            names.add(param.envvar)
        elif param.envvar:
            names.update(param.envvar)
    return names


@pytest.fixture
def parse(monkeypatch):
    """parse(argv, env) -> (command path, params) as click resolves them in the service."""
    def run(argv: list[str], env: dict[str, str]) -> tuple[str, dict[str, Any]]:
        for name in list(os.environ):
            if name.startswith("BATCHGATE_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        command, args, path = resolve(argv)
        with command.make_context(path, list(args)) as ctx:
            return path, dict(ctx.params)
    return run


def redis_address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "", parsed.port or 6379


def redis_service_port() -> int:
    args = SERVICES["redis"]["command"]
    return int(args[args.index("--port") + 1]) if "--port" in args else 6379


def container_ports(service: dict[str, Any]) -> set[int]:
    return {int(str(mapping).split(":")[-1].split("/")[0]) for mapping in
            service.get("ports", [])}


def test_services_present():
    assert {"redis", "gateway", "rq-worker", "prometheus"} <= set(SERVICES)
    assert CONSUMERS, "no consumer service"
    assert set(BATCHGATE_SERVICES) == {"gateway", "exporter", *CONSUMERS}
    for name, service in SERVICES.items():
        assert service.get("image") or service.get("build"), name


@pytest.mark.parametrize("name", BATCHGATE_SERVICES)
def test_batchgate_command_is_real(name, parse):
    service = SERVICES[name]
    argv = service["command"][1:]
    # the installed entry point accepts the command line (unknown options fail here) ...
    assert BATCHGATE
    shown = subprocess.run([BATCHGATE, *argv, "--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Usage: batchgate")
    # ... and its parser accepts every value, with the service's environment
    env = environment(service)
    path, params = parse(argv, env)
    command = resolve(argv)[0]
    unknown = set(env) - envvars(command)
    assert not unknown, f"{name}: env vars {unknown} are not read by `{path}`"
    assert redis_address(params["redis_url"]) == ("redis", redis_service_port())


def test_gateway_ports_match(parse):
    gateway = SERVICES["gateway"]
    _, params = parse(gateway["command"][1:], environment(gateway))
    assert params["host"] == "0.0.0.0"
    assert container_ports(gateway) == {params["port"]}
    assert f"127.0.0.1:{params['port']}/healthz" in " ".join(gateway["healthcheck"]["test"])
    from producer.gateway.app import create_app
    paths = {getattr(route, "path", None) for route in create_app().routes}
    assert {"/healthz", "/metrics"} <= paths
    # an empty token (the default) means no auth, not a token of ""
    assert RAW["services"]["gateway"]["environment"]["BATCHGATE_GATEWAY_TOKEN"] == \
        "${BATCHGATE_GATEWAY_TOKEN:-}"


def test_consumers_one_per_gpu_same_policy(parse):
    device_ids: list[str] = []
    policies = []
    for name in CONSUMERS:
        service = SERVICES[name]
        _, params = parse(service["command"][1:], environment(service))
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert len(device["device_ids"]) == 1, f"{name}: one GPU per consumer service"
        device_ids += device["device_ids"]
        assert params["device"] == "cuda:0", f"{name}: a container sees its GPU as cuda:0"
        assert params["metrics_port"], f"{name}: no --metrics-port for Prometheus"
        policies.append({k: params.get(k) for k in ("strategy", *LIMITS)})
        module, _, attr = params["model_spec"].partition(":")
        assert hasattr(importlib.import_module(module), attr), params["model_spec"]
    assert len(set(device_ids)) == len(device_ids), "two consumers reserve the same GPU"
    assert all(p == policies[0] for p in policies), \
        "consumers of one queue must pass the same policy flags (PolicyConflict otherwise)"


def test_rq_worker_command_is_real(parse, tmp_path):
    worker = SERVICES["rq-worker"]
    args = worker["command"]
    assert args[:2] == ["rq", "worker"]
    rq = shutil.which("rq", path=os.path.dirname(sys.executable)) or shutil.which("rq")
    assert rq, "rq is not installed"
    assert subprocess.run([rq, "worker", "--help"], capture_output=True,
                          timeout=60).returncode == 0
    shown = subprocess.run([rq, *args[1:], "--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    from rq.cli.cli import main as rq_main
    with rq_main.commands["worker"].make_context("rq worker", list(args[2:])) as ctx:
        params = ctx.params
    assert params["worker_class"] == "rq.worker.SimpleWorker"
    module, _, cls = params["worker_class"].rpartition(".")
    assert hasattr(importlib.import_module(module), cls)
    assert redis_address(params["url"]) == ("redis", redis_service_port())
    # the worker listens on the RQ queue `batchgate bulk submit` uses, run in this service
    (tmp_path / "in.jsonl").write_text("1\n")
    _, submit = parse(["bulk", "submit", str(tmp_path / "in.jsonl"), "--output",
                       str(tmp_path / "out.jsonl")], environment(worker))
    assert list(params["queues"]) == [submit["rq_queue"]]
    assert redis_address(submit["redis_url"]) == ("redis", redis_service_port())
    unknown = set(environment(worker)) - envvars(resolve(["bulk", "submit"])[0])
    assert not unknown, f"rq-worker: env vars {unknown} are not read by `batchgate bulk`"
    assert any(str(v).endswith(":/data") for v in worker.get("volumes", []))


def test_redis_command_runs_with_aof_and_noeviction():
    service = SERVICES["redis"]
    image = service["image"]
    assert int(image.split(":")[1].split(".")[0]) >= 7, "batchgate needs Redis >= 7"
    args = service["command"]
    assert args[0] == "redis-server"
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not on PATH")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bg-compose-redis-")
    proc = subprocess.Popen(["redis-server", *args[1:], "--port", str(port), "--bind",
                             "127.0.0.1", "--dir", workdir], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, decode_responses=True)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server rejected the compose command line"
                subprocess.run(["sleep", "0.02"])
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        client.close()
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    assert any(str(v).endswith(":/data") for v in service["volumes"]), "AOF needs a volume"


def test_prometheus_scrapes_every_service(parse):
    prometheus = SERVICES["prometheus"]
    mounts = [str(v).split(":") for v in prometheus["volumes"]]
    config_mount = next(m for m in mounts if m[1] == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / config_mount[0]).read_text())
    assert f"--config.file={config_mount[1]}" in prometheus["command"]
    targets = {target for job in config["scrape_configs"]
               if job.get("metrics_path", "/metrics") == "/metrics"
               for static in job["static_configs"] for target in static["targets"]}
    expected = set()
    gateway = SERVICES["gateway"]
    expected.add(f"gateway:{parse(gateway['command'][1:], environment(gateway))[1]['port']}")
    exporter = SERVICES["exporter"]
    expected.add(f"exporter:{parse(exporter['command'][1:], environment(exporter))[1]['port']}")
    for name in CONSUMERS:
        service = SERVICES[name]
        params = parse(service["command"][1:], environment(service))[1]
        expected.add(f"{name}:{params['metrics_port']}")
    assert targets == expected


def dockerfile_stages() -> dict[str, dict[str, Any]]:
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            current = {"from": words[1], "args": {}, "copies": [], "cmd": None}
            stages[words[3] if len(words) > 3 and words[2].upper() == "AS" else
                   f"#{len(stages)}"] = current
        elif words[0] == "ARG" and "=" in words[1] and current:
            key, value = words[1].split("=", 1)
            current["args"][key] = value
        elif words[0] == "COPY":
            current["copies"].append(words[1:-1])
        elif words[0] == "CMD":
            current["cmd"] = json.loads(line.split(None, 1)[1])
    return stages


def test_dockerfile_builds_what_compose_runs(parse):
    tomllib = pytest.importorskip("tomllib")
    stages = dockerfile_stages()
    for name, stage in stages.items():
        if stage["cmd"] and stage["cmd"][0] == "batchgate":
            parse(stage["cmd"][1:], {})  # the image's default command parses
        elif name in ("app", "consumer"):
            pytest.fail(f"stage {name} has no batchgate CMD")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"].get("optional-dependencies", {}))
    for name, service in SERVICES.items():
        target = (service.get("build") or {}).get("target")
        if target:
            assert target in stages, f"{name}: no Dockerfile stage {target!r}"
    copied = {src.rstrip("/") for stage in stages.values() for copy in stage["copies"]
              for src in copy}
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    packages = {name.rstrip("*") for name in
                pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied
    assert "README.md" in copied  # pyproject's readme, read by pip install
    # pip only warns about an unknown extra, so a typo here would build an image without
    # the gateway or torch
    wanted = {extra for stage in stages.values() for key, value in stage["args"].items()
              if key.endswith("_EXTRAS") for extra in value.split(",")}
    assert wanted - extras == set(), "Dockerfile installs extras pyproject.toml lacks"
