"""CURVE between the gateway and its workers: ``agentgate keys`` writes private key files once;
``agentgate serve --curve-keys`` hands the gateway its keys and the spawned workers the
directory; a ``Dispatcher`` whose ``WorkerClient`` has the keys streams from a CURVE worker and
its KV index follows the worker's (CURVE) event and replay sockets, while a client without them
never gets a Welcome; a real ``agentgate serve --curve-keys`` answers a chat completion."""

import asyncio
import stat
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from engine.protocol import Finished, Generate, SamplingSpec
from engine.worker.curve import KEY_FILES, CurveClientKeys, load_client_keys
from gateway.cli import _build_parser, main, serve_kwargs
from gateway.dispatch import Dispatcher, WorkerClient
from gateway.dispatch_errors import HandshakeError
from gateway.generation import route_request
from gateway.serve import WorkerProcess
from tests.gateway.serve_proc import _cmdline, serve_proc

TEST_TIMEOUT_S = 60.0
WAIT_S = 10.0
REFUSED_WAIT_S = 1.0


def test_keys_writes_private_secrets_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_dir = tmp_path / "keys"
    assert main(["keys", str(key_dir)]) == 0
    out = capsys.readouterr().out
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    for name in KEY_FILES:
        mode = stat.S_IMODE((key_dir / name).stat().st_mode)
        assert mode == (0o600 if name.endswith("_secret") else 0o644), f"{name}: {mode:o}"
        assert str(key_dir / name) in out, out
    keys = load_client_keys(key_dir)
    assert keys.secret.decode() not in out and keys.public.decode() not in out, out
    before = {name: (key_dir / name).read_bytes() for name in KEY_FILES}
    assert main(["keys", str(key_dir)]) == 2
    assert "--force" in capsys.readouterr().err
    assert {name: (key_dir / name).read_bytes() for name in KEY_FILES} == before
    assert main(["keys", str(key_dir), "--force"]) == 0
    assert load_client_keys(key_dir).secret != keys.secret
    assert [p.name for p in key_dir.iterdir() if p.name not in KEY_FILES] == []


def test_serve_curve_keys_reach_the_gateway_and_the_workers(
    curve_key_dir: Path, sim_model_dir: Path, tmp_path: Path
) -> None:
    args = _build_parser().parse_args([
        "serve", "--model", str(sim_model_dir), "--tenant-secret-file", str(tmp_path / "s"),
        "--curve-keys", str(curve_key_dir), "--cost", "h200"])
    kwargs = serve_kwargs(args, env={"AGENTGATE_GCACHE": "off"})
    assert kwargs["worker_args"] == ["--cost", "h200", "--curve-keys", str(curve_key_dir.resolve())]
    assert kwargs["gateway_options"]["curve_keys"] == load_client_keys(curve_key_dir)
    args.curve_keys = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="client.key_secret"):
        serve_kwargs(args, env={"AGENTGATE_GCACHE": "off"})


def test_dispatcher_with_keys_streams_and_follows_the_kv_events(
    curve_worker: WorkerProcess, curve_key_dir: Path
) -> None:
    async def main() -> None:
        client = WorkerClient(curve_worker.listen, curve=load_client_keys(curve_key_dir),
                              first_token_timeout_s=WAIT_S)
        dispatcher = Dispatcher([client], router="agentgate")
        client.start()
        try:
            await asyncio.wait_for(client.wait_welcome(), WAIT_S)
            prompt = [(i * 31) % 300 + 1 for i in range(160)]
            request = Generate(request_id="c1", input_ids=prompt,
                               sampling=SamplingSpec(max_new_tokens=2, ignore_eos=True))
            items = [item async for item in dispatcher.generate(
                request, route_request(dispatcher, request))]
            assert isinstance(items[-1], Finished), items
            hashes = route_request(dispatcher, request).page_hashes
            await _until(lambda: bool(_match(dispatcher, hashes)), "the prompt's pages")
        finally:
            client.close()
            await dispatcher.close()

    _run(main())


@pytest.mark.parametrize("curve", ["none", "stranger"])
def test_client_without_the_keys_gets_no_welcome(
    curve_worker: WorkerProcess, curve_key_dir: Path, curve: str
) -> None:
    import zmq

    keys = load_client_keys(curve_key_dir)
    public, secret = zmq.curve_keypair()
    stranger = CurveClientKeys(public=public, secret=secret, server_public=keys.server_public)

    async def main() -> None:
        client = WorkerClient(curve_worker.listen, connect_timeout_s=REFUSED_WAIT_S,
                              curve=stranger if curve == "stranger" else None)
        with pytest.raises(HandshakeError):
            await client.connect()

    _run(main())


def test_serve_with_curve_keys_answers_a_chat_completion(
    curve_key_dir: Path, sim_model_dir: Path, tmp_path: Path
) -> None:
    with serve_proc(sim_model_dir, tmp_path, "--curve-keys", str(curve_key_dir)) as serve:
        body = serve.chat(max_tokens=3)
        assert body["choices"][0]["message"]["content"] is not None, body
        assert body["usage"]["completion_tokens"] == 3, body
        [worker] = serve.worker_pids()
        argv = _cmdline(worker).split(b"\0")
        assert argv[argv.index(b"--curve-keys") + 1] == str(curve_key_dir.resolve()).encode(), argv
        assert "refused a CURVE client" not in serve.output()


# ---------------------------------------------------------------------- helpers


def _match(d: Dispatcher, hashes: list[int]) -> dict[str, Any]:
    assert d.link is not None and d.link.feed is not None
    with d.link.feed.lock:
        return d.link.feed.index.match(hashes)


async def _until(check: Any, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def _run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await coro

    asyncio.run(bounded())
