"""``agentgate serve``'s command line: flags reach the gateway config and the spawned workers,
a taken port fails before any worker starts, "gateway on" is logged only once the port answers,
``--help`` shows defaults, the tenant secret is created once and kept, and gateway and worker
log lines share one format."""

import argparse
import os
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine.worker import cli as worker_cli
from gateway.cli import _build_parser, serve_kwargs
from gateway.supervisor import RESTART_INITIAL_S, RESTART_MAX_S, restart_delay_s
from gateway.tenant_secret import SECRET_BYTES, TenantSecretError, load_tenant_secret
from tests.gateway.live import free_port
from tests.gateway.serve_proc import post_json, proc_state, serve_proc, wait_until

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \[(gateway|worker w\d)\] "
                      r"[\w.]+: ")


def _parse(*argv: str) -> argparse.Namespace:
    return _build_parser().parse_args(["serve", *argv])


def test_flags_reach_the_gateway_config(sim_model_dir: Path, tmp_path: Path) -> None:
    args = _parse("--model", str(sim_model_dir), "--first-token-timeout", "5",
                  "--idle-timeout", "2.5",
                  "--served-model-name", "a", "--served-model-name", "b",
                  "--cors-origin", "https://x.example", "--tenant-secret-file",
                  str(tmp_path / "s"), "--header-timeout", "3", "--body-timeout", "4",
                  "--max-connections", "7", "--drain-timeout", "0")
    kwargs = serve_kwargs(args, env={"AGENTGATE_GCACHE": "off"})
    options = kwargs["gateway_options"]
    assert options["first_token_timeout_s"] == 5.0 and options["idle_timeout_s"] == 2.5
    assert options["served_model_names"] == ("a", "b")
    assert options["cors_origins"] == ("https://x.example",)
    assert options["tenant_secret"] == (tmp_path / "s").read_bytes()
    limits = kwargs["limits"]
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.max_connections,
            limits.drain_timeout_s) == (3.0, 4.0, 7, 0.0)
    assert kwargs["worker_args"] == []


def test_worker_flags_are_forwarded_only_when_set(sim_model_dir: Path, tmp_path: Path) -> None:
    args = _parse("--model", str(sim_model_dir), "--cost", "h200", "--kv-budget-mb", "64",
                  "--page-size", "32", "--max-batched-tokens", "256", "--no-prefix-cache",
                  "--tenant-secret-file", str(tmp_path / "s"))
    argv = serve_kwargs(args, env={"AGENTGATE_GCACHE": "off"})["worker_args"]
    assert argv == ["--page-size", "32", "--kv-budget-mb", "64", "--max-batched-tokens", "256",
                    "--no-prefix-cache", "--cost", "h200"], argv


def test_serve_shares_a_file_gcache_by_default(sim_model_dir: Path, tmp_path: Path) -> None:
    base = ("--model", str(sim_model_dir), "--tenant-secret-file", str(tmp_path / "s"))
    default = ["--gcache", f"file:{Path.home() / '.cache' / 'agentgate' / 'gcache'}"]
    assert serve_kwargs(_parse(*base), env={})["worker_args"] == default
    # NOTE: the workers inherit AGENTGATE_GCACHE, so serve adds nothing when it is set
    assert serve_kwargs(_parse(*base), env={"AGENTGATE_GCACHE": "redis://h:1/0"})[
        "worker_args"] == []
    for spec in ("off", "redis://127.0.0.1:6379/0"):
        assert serve_kwargs(_parse(*base, "--gcache", spec), env={})["worker_args"] == [
            "--gcache", spec]
    assert worker_cli.engine_config(_worker_parse("--gcache", "off"), env={}).gcache is None
    assert worker_cli.engine_config(_worker_parse(), env={"AGENTGATE_GCACHE": ""}).gcache is None


def test_default_gcache_outlives_a_restart(sim_model_dir: Path, tmp_path: Path) -> None:
    """``agentgate serve`` with no GCache flag, twice, in one home directory: the second
    gateway's first request is served from the pages the first one's workers wrote."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"env": {"HOME": str(home), "AGENTGATE_GCACHE": ""}}
    body = {"model": "m", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(200))}]}
    store = home / ".cache" / "agentgate" / "gcache"
    with serve_proc(sim_model_dir, tmp_path, **env) as serve:
        first = post_json(f"{serve.base_url}/v1/chat/completions", body)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
        wait_until(lambda: _files(store) > 0, 30, f"pages in {store}")
        written = _files(store)
        time.sleep(0.5)  # NOTE: let the writer finish the request's path
        serve.stop()
    assert written > 0
    with serve_proc(sim_model_dir, tmp_path, **env) as serve:
        again = post_json(f"{serve.base_url}/v1/chat/completions", body)
        serve.stop()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // 2, (cached, again["usage"])


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _worker_parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(["--listen", "tcp://127.0.0.1:1", "--events", "tcp://127.0.0.1:2",
                              "--backend", "sim", *argv])


@pytest.mark.parametrize(("flag", "value"), [("--header-timeout", "0"), ("--idle-timeout", "-1"),
                                             ("--max-connections", "0")])
def test_bad_flag_values_are_refused(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(flag, value)
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_help_shows_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    text = " ".join(out.split())
    for flag, default in [("--header-timeout", "10.0"), ("--body-timeout", "30.0"),
                          ("--max-connections", "2048"), ("--drain-timeout", "30.0"),
                          ("--first-token-timeout", "60.0"), ("--idle-timeout", "30.0"),
                          ("--port", "8000"), ("--cost", "cpu")]:
        assert re.search(re.escape(flag) + r" .*?\(default: " + re.escape(default) + r"\)",
                         text), (flag, out)
    assert "(default: None)" not in text, out


def test_cost_choices_match_the_engine() -> None:
    from engine.worker.server import COSTS

    assert worker_cli.COSTS == COSTS


def test_restart_backoff_doubles_to_a_cap_and_resets_after_a_healthy_run() -> None:
    delays = [None]
    for _ in range(10):
        delays.append(restart_delay_s(delays[-1], uptime_s=1.0))
    assert delays[1:4] == [RESTART_INITIAL_S, 2 * RESTART_INITIAL_S, 4 * RESTART_INITIAL_S]
    assert delays[-1] == RESTART_MAX_S
    assert restart_delay_s(RESTART_MAX_S, uptime_s=61.0) == RESTART_INITIAL_S


def test_tenant_secret_is_created_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "agentgate" / "tenant-secret"
    first = load_tenant_secret(path)
    assert len(first) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_tenant_secret(path) == first
    assert load_tenant_secret(tmp_path / "other") != first
    assert load_tenant_secret(path, "an-environment-secret!") == b"an-environment-secret!"
    with pytest.raises(TenantSecretError, match="at least 16 bytes"):
        load_tenant_secret(path, "short")


def test_taken_port_fails_before_any_worker_starts(sim_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", str(sim_model_dir),
             "--backend", "sim", "--port", str(port)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "AGENTGATE_TENANT_SECRET": "test-tenant-secret-0123456789"})
    assert proc.returncode == 2, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "listening on" not in proc.stderr, f"a worker started:\n{proc.stderr}"
    assert time.monotonic() - start < 60


def test_gateway_on_is_logged_once_the_port_answers(sim_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(sim_model_dir), "--backend",
           "sim", "--port", str(port), "--tenant-secret-file", str(tmp_path / "secret")]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "gateway on" in log_path.read_text() or proc.poll() is not None, 90,
                   "the gateway-on line")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(60)


def test_sim_fleet_with_worker_flags_starts_and_logs_in_one_format(
    sim_model_dir: Path, tmp_path: Path
) -> None:
    args = ("--workers", "2", "--cost", "h200", "--kv-budget-mb", "64", "--page-size", "32")
    with serve_proc(sim_model_dir, tmp_path, *args) as serve:
        pids = wait_until(lambda: len(serve.worker_pids()) == 2 and serve.worker_pids(), 30,
                          "two workers")
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"--cost" in cmdline and cmdline[cmdline.index(b"--cost") + 1] == b"h200"
            assert cmdline[cmdline.index(b"--kv-budget-mb") + 1] == b"64", cmdline
            assert cmdline[cmdline.index(b"--parent-pid") + 1] == str(serve.proc.pid).encode()
        assert serve.chat()["usage"]["completion_tokens"] == 3
        serve.stop()
    assert all(proc_state(pid) in (None, "Z") for pid in pids)
    lines = [line for line in serve.output().splitlines() if line.strip()]
    roles = {m[1] for line in lines if (m := LOG_LINE.match(line))}
    assert {"gateway", "worker w0", "worker w1"} <= roles, lines
    odd = [line for line in lines if not LOG_LINE.match(line)]
    assert not odd, f"lines in another format: {odd}"


def test_parent_watch_thread_notices_a_killed_parent(tmp_path: Path) -> None:
    """The portable fallback of ``--parent-pid`` on its own (no prctl): a grandchild watching
    its parent exits once that parent is SIGKILLed."""
    child = ("import os, sys, threading; from engine.worker.cli import watch_parent; "
             "gone = threading.Event(); watch_parent(os.getppid(), gone.set); "
             "print(os.getpid(), flush=True); sys.exit(0 if gone.wait(60) else 1)")
    parent = ("import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        wait_until(lambda: proc_state(grandchild) in (None, "Z"), 15,
                   "the watching process exited after its parent was killed")
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_started_and_died_at_once_is_returned_not_refused() -> None:
    """``spawn_child`` saw the start line, then the child died before its next poll (CI: a test
    SIGKILLed a gateway process that already served while ``serve`` still waited): it is a
    started child whose exit the supervisor handles, not one that "did not start"."""
    import re

    from gateway.worker_process import spawn_child

    child = ("import os, signal, sys; print('ready to serve', file=sys.stderr, flush=True); "
             "os.kill(os.getpid(), signal.SIGKILL)")
    for _ in range(5):  # NOTE: bounded; each run dies at once
        proc, match, _lines = spawn_child([sys.executable, "-c", child],
                                          re.compile(r"ready to (\w+)"), 30.0)
        assert match[1] == "serve"
        assert proc.wait(10) == -9


def test_serve_starts_an_encoder_for_a_model_with_a_vision_tower(
    demo_model_dir: Path, sim_model_dir: Path, tmp_path: Path,
) -> None:
    secret = ("--tenant-secret-file", str(tmp_path / "s"))
    env = {"AGENTGATE_GCACHE": "off"}
    kwargs = serve_kwargs(_parse("--model", str(demo_model_dir), *secret), env=env)
    assert kwargs["encoder_args"] == ["--cache-mb", "256"]
    assert kwargs["gateway_options"]["encoders"] == () and kwargs["worker_args"] == []
    # NOTE: no tower, no encoder; `off` (flag or environment) starts none either
    assert serve_kwargs(_parse("--model", str(sim_model_dir), *secret), env=env)[
        "encoder_args"] is None
    for argv, extra_env in ((("--encoder", "off"), {}), ((), {"AGENTGATE_ENCODER": "off"})):
        kwargs = serve_kwargs(_parse("--model", str(demo_model_dir), *secret, *argv),
                              env={**env, **extra_env})
        assert kwargs["encoder_args"] is None and kwargs["gateway_options"]["encoders"] == ()
    # NOTE: attached encoders: the gateway and every worker get their endpoints, none started
    kwargs = serve_kwargs(_parse("--model", str(demo_model_dir), *secret, "--encoder",
                                 "tcp://10.0.0.5:5570", "--encoder", "tcp://10.0.0.6:5570",
                                 "--embed-redis", "redis://127.0.0.1:6379/3"), env=env)
    assert kwargs["encoder_args"] is None
    assert kwargs["gateway_options"]["encoders"] == ("tcp://10.0.0.5:5570", "tcp://10.0.0.6:5570")
    assert kwargs["worker_args"] == ["--encoder", "tcp://10.0.0.5:5570", "--encoder",
                                     "tcp://10.0.0.6:5570", "--embed-redis",
                                     "redis://127.0.0.1:6379/3"]
    kwargs = serve_kwargs(_parse("--model", str(demo_model_dir), *secret, "--embed-redis",
                                 "redis://127.0.0.1:6379/3", "--encoder-cache-mb", "8"), env=env)
    assert kwargs["encoder_args"] == ["--cache-mb", "8", "--redis", "redis://127.0.0.1:6379/3"]
    assert kwargs["worker_args"] == ["--embed-redis", "redis://127.0.0.1:6379/3"]
