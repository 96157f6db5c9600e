"""compose.yaml and the Dockerfile against the real CLI, without Docker (README "Deploy").

Every ``agentgate ...`` a service runs parses with the parser the process itself uses
(``gateway.cli._build_parser`` for ``serve`` / ``keys`` / ``model init``, ``engine.worker.cli``'s
flags for ``worker``), and what the commands name lines up: the gateway's workers and Redis are
services listening on those ports, the published port is the gateway's, dependencies, health
checks, volumes and secrets exist. Each variant is checked: the default stack and profile ``sim``.
The Dockerfile writes the model the services serve; deploy/agentgate.service's ``serve`` parses and
its stop timeout outlasts the drain. ``docker compose config`` runs too where Docker Compose is
installed.
"""

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.worker.cli import add_arguments
from gateway.api_keys import load_api_keys
from gateway.cli import _build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
# variant -> the profiles it activates
VARIANTS = {"default": (), "sim": ("sim",), "sglang": ("sglang",)}
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]")


def test_commands_parse_with_the_real_cli() -> None:
    for name, argv in _agentgate_commands():
        if argv[0] == "keys":
            continue  # NOTE: test_keys_service_writes_the_curve_volume
        error = _cli_error(argv)
        assert error is None, f"service {name}: agentgate {shlex.join(argv)}: {error}"


def test_curve_flags_parse() -> None:
    commands = [(n, a) for n, a in _agentgate_commands() if a[0] in ("serve", "worker")]
    missing = [n for n, argv in commands if "--curve-keys" not in argv]
    assert not missing, f"services without --curve-keys (a worker on 0.0.0.0 needs it): {missing}"
    for name, argv in commands:
        assert _cli_error(argv) is None, f"service {name}: {_cli_error(argv)}"


def test_keys_service_writes_the_curve_volume() -> None:
    services = _services()
    name = _keys_service()
    argv = _command(services[name])
    script = _shell_script(services[name])
    assert script is not None and re.search(r"\|\|\s*(exec\s+)?agentgate keys", script), (
        f"service {name}: {script!r} must skip `agentgate keys` when keys exist (it refuses to "
        "overwrite, and a failure stops every service that depends on it)")
    assert services[name].get("restart") == "no", f"service {name}: a one-shot must not restart"
    writable = _mounts(services[name])
    assert writable.get(argv[1], ("", True))[1] is False, (
        f"service {name}: {argv[1]} must be a read-write volume, mounts: {writable}")
    for user, user_argv in _agentgate_commands():
        if "--curve-keys" in user_argv:
            keys_dir = _flag(user_argv, "--curve-keys")
            assert _mounts(services[user]).get(keys_dir, ("",))[0] == writable[argv[1]][0], (
                f"service {user}: --curve-keys {keys_dir} is not the volume {name} writes")
    assert _cli_error(argv) is None, f"service {name}: {_cli_error(argv)}"


def test_dockerfile_writes_the_model_the_services_serve() -> None:
    text = DOCKERFILE.read_text()
    [line] = re.findall(r"agentgate (model init [^\s&;\\]+)", text)
    argv = shlex.split(line)
    assert _cli_error(argv) is None, f"Dockerfile: agentgate {line}: {_cli_error(argv)}"
    for name, svc_argv in _agentgate_commands():
        if svc_argv[0] == "serve" or (svc_argv[0] == "worker" and _backend(svc_argv) != "sim"):
            assert _flag(svc_argv, "--model") == argv[2], (
                f"service {name}: --model {_flag(svc_argv, '--model')}, the image has {argv[2]}")
    installs = re.findall(r"pip install .*", text)
    assert any("torch==2.13.0" in i and "download.pytorch.org/whl/cpu" in i for i in installs)
    assert not [i for i in installs if "torchvision" in i], installs
    assert re.search(r"^USER (?!root|0\b)", text, re.M), "the image must not run as root"
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = [p.rstrip("*") for p in find["find"]["include"]]
    uncopied = [p for p in packages if f"COPY {p} /src/{p}" not in text]
    assert not uncopied, f"the Dockerfile does not copy the packages {uncopied} into /src"
    assert re.search(r'^ENTRYPOINT \["agentgate"\]', text, re.M)


def test_the_sglang_image_has_agentgate_and_the_model_its_worker_serves() -> None:
    """Dockerfile.sglang (profile ``sglang``): every package, the same model path, no CPU torch
    over SGLang's CUDA build, not root."""
    text = (ROOT / "Dockerfile.sglang").read_text()
    [line] = re.findall(r"agentgate (model init [^\s&;\\]+)", text)
    model = shlex.split(line)[2]
    served = []
    for name, svc in _services().items():
        build = svc.get("build")
        if isinstance(build, dict) and build.get("dockerfile") == "Dockerfile.sglang":
            argv = _command(svc)
            assert _backend(argv) == "sglang" and _flag(argv, "--model") == model, name
            served.append(name)
    assert served, "no service runs Dockerfile.sglang's image"
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert all(f"COPY {p.rstrip('*')} /src/{p.rstrip('*')}" in text
               for p in find["find"]["include"])
    assert not re.findall(r"pip install .*torch", text)
    assert re.search(r"^USER (?!root|0\b)", text, re.M)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_workers_are_services_on_those_ports(variant: str) -> None:
    services = _enabled(variant)
    for gateway, argv in _gateways(variant):
        attached = _flags(argv, "--worker")
        assert attached and _flag(argv, "--workers") == "0", f"{gateway}: {shlex.join(argv)}"
        for endpoint in attached:
            host, port = _host_port(endpoint)
            assert host in services, f"{gateway}: --worker {endpoint}: no service {host!r}"
            worker = _command(services[host])
            assert worker[0] == "worker", f"{gateway}: {host} runs agentgate {worker[0]}"
            listen_host, listen_port = _host_port(_flag(worker, "--listen"))
            assert (listen_host, listen_port) == ("0.0.0.0", port), (
                f"{gateway}: --worker {endpoint}, but {host} --listen "
                f"{_flag(worker, '--listen')}")
            others = [_host_port(_flag(worker, f))[1] for f in ("--events", "--replay")]
            assert len({port, *others}) == 3, f"{host}: ports {port}, {others}"
            backend = next((b for b in ("sim", "sglang") if b in VARIANTS[variant]), "native")
            assert _backend(worker) == backend, host


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_redis_is_the_redis_service(variant: str) -> None:
    services = _enabled(variant)
    for gateway, argv in _gateways(variant):
        url = urllib.parse.urlsplit(_flag(argv, "--redis"))
        assert url.scheme == "redis" and url.hostname in services, f"{gateway}: {url.geturl()}"
        redis = services[url.hostname]
        assert redis["image"].startswith("redis:") and (url.port or 6379) == 6379
        command = redis["command"]
        assert command[:1] == ["redis-server"] and "--appendonly" in command, command
        assert _flag(command, "--appendonly") == "yes", command
        assert _mounts(redis).get("/data", ("",))[0] in _compose()["volumes"], redis["volumes"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_published_port_is_the_gateway_port(variant: str) -> None:
    services = _enabled(variant)
    for gateway, argv in _gateways(variant):
        assert _flag(argv, "--host") in WILDCARD_HOSTS, f"{gateway}: unreachable in its container"
        targets = {_container_port(p) for p in services[gateway].get("ports", [])}
        assert targets == {int(_flag(argv, "--port"))}, f"{gateway}: publishes {targets}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_depends_on_names_enabled_services(variant: str) -> None:
    services = _enabled(variant)
    for name, svc in services.items():
        for dep, cond in _depends_on(svc).items():
            assert dep in services, f"{name} depends on {dep!r}, not a service in {variant}"
            assert cond in CONDITIONS, f"{name} -> {dep}: condition {cond!r}"
            if cond == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health check"
            if cond == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot"
    for gateway, argv in _gateways(variant):
        redis = urllib.parse.urlsplit(_flag(argv, "--redis")).hostname
        needed = {redis, _keys_service(), *(_host_port(w)[0] for w in _flags(argv, "--worker"))}
        assert needed <= set(_depends_on(services[gateway])), (
            f"{gateway} depends on {sorted(_depends_on(services[gateway]))}, needs {needed}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_health_checks(variant: str) -> None:
    services = _enabled(variant)
    for gateway, argv in _gateways(variant):
        redis = urllib.parse.urlsplit(_flag(argv, "--redis")).hostname
        assert "healthcheck" in services[redis], redis
        probe = " ".join(services[gateway]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{_flag(argv, '--port')}/ready" in probe, probe
    for name, svc in services.items():
        argv = _command(svc)
        if argv and argv[0] == "worker":
            probe = " ".join(svc["healthcheck"]["test"])
            assert str(_host_port(_flag(argv, "--listen"))[1]) in probe, f"{name}: {probe}"


def test_volumes_and_secrets_are_declared() -> None:
    compose = _compose()
    for name, svc in compose["services"].items():
        for source, _ in _mounts(svc).values():
            assert source.startswith((".", "/")) or source in compose["volumes"], (
                f"service {name}: volume {source!r} is not declared")
        for secret in svc.get("secrets", []):
            assert secret in compose["secrets"], f"service {name}: secret {secret!r}"
        argv = _command(svc)
        if argv and argv[0] == "serve":
            keys_file = _flag(argv, "--api-keys")
            assert keys_file in {f"/run/secrets/{s}" for s in svc.get("secrets", [])}, keys_file
    for secret in compose["secrets"].values():
        assert load_api_keys(ROOT / secret["file"]).tenants, secret


def test_systemd_unit_outlasts_the_drain() -> None:
    unit = (ROOT / "deploy" / "agentgate.service").read_text().replace("\\\n", " ")
    [exec_start] = re.findall(r"^ExecStart=\S+/agentgate (serve .*)", unit, re.M)
    argv = shlex.split(exec_start)
    assert _cli_error(argv) is None, f"ExecStart: {_cli_error(argv)}"
    stop_s = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M)[1])
    assert stop_s > float(_flag(argv, "--drain-timeout")), unit
    assert re.search(r"^KillMode=mixed", unit, re.M), "SIGTERM to serve only: it drains first"


def test_docker_compose_config() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"],
                                        capture_output=True).returncode != 0:
        pytest.skip("docker compose is not installed")
    for profiles in VARIANTS.values():
        flags = [arg for p in profiles for arg in ("--profile", p)]
        done = subprocess.run([docker, "compose", "-f", str(COMPOSE), *flags, "config", "-q"],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _enabled(variant: str) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile ...`` starts for ``variant``."""
    active = set(VARIANTS[variant])
    return {n: s for n, s in _services().items()
            if not s.get("profiles") or active & set(s["profiles"])}


def _gateways(variant: str) -> list[tuple[str, list[str]]]:
    """The variant's own ``serve`` services (the default stack's are not the sim stack's)."""
    gateways = [(n, _command(s)) for n, s in _enabled(variant).items()
                if tuple(s.get("profiles", ())) == VARIANTS[variant]
                and _command(s)[:1] == ["serve"]]
    assert gateways, f"no gateway in {variant}"
    return gateways


def _keys_service() -> str:
    [name] = [n for n, argv in _agentgate_commands() if argv[0] == "keys"]
    return name


def _agentgate_commands() -> list[tuple[str, list[str]]]:
    return [(n, _command(s)) for n, s in _services().items() if _command(s)]


def _command(svc: dict[str, Any]) -> list[str]:
    """The arguments after ``agentgate`` (the image's entrypoint, or inside a shell script);
    empty for another image."""
    if "build" not in svc:
        return []
    script = _shell_script(svc)
    if script is None:
        command = svc.get("command", [])
        return shlex.split(command) if isinstance(command, str) else list(command)
    words = shlex.split(script)
    start = words.index("agentgate") + 1
    end = next((i for i in range(start, len(words)) if words[i] in (";", "||", "&&", "|")),
               len(words))
    return words[start:end]


def _shell_script(svc: dict[str, Any]) -> str | None:
    entrypoint = svc.get("entrypoint") or []
    if list(entrypoint)[-1:] != ["-c"]:
        return None
    command = svc["command"]
    return command if isinstance(command, str) else " ".join(command)


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) of the short-syntax volumes."""
    mounts = {}
    for spec in svc.get("volumes", []):
        source, target, *mode = spec.split(":")
        mounts[target] = (source, "ro" in mode)
    return mounts


def _depends_on(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def _container_port(spec: str | dict[str, Any]) -> int:
    return int(spec["target"]) if isinstance(spec, dict) else int(str(spec).rsplit(":", 1)[-1])


def _host_port(endpoint: str) -> tuple[str, int]:
    url = urllib.parse.urlsplit(endpoint)
    assert url.scheme == "tcp" and url.hostname and url.port, endpoint
    return url.hostname, url.port


def _flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def _flag(argv: list[str], flag: str) -> str:
    values = _flags(argv, flag)
    assert len(values) == 1, f"{flag} given {len(values)} times in {shlex.join(argv)}"
    return values[0]


def _backend(worker_argv: list[str]) -> str:
    return (_flags(worker_argv, "--backend") or ["native"])[0]


def _cli_error(argv: list[str]) -> str | None:
    """What the real parser says about ``agentgate ARGV`` (None: it parses)."""
    if argv[0] == "worker":
        parser = argparse.ArgumentParser(prog="agentgate worker")
        add_arguments(parser)
        argv = argv[1:]
    else:
        parser = _build_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return None
