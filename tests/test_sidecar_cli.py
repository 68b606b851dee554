"""The CLI: help text for every option, and `serve` and `route` as real subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
from conftest import Server

from prefixcache.sidecar.cli import build_parser
from prefixcache.sidecar.cli.serve_command import listen, listen_url, read_secret, serve
from prefixcache.sidecar.environment import SidecarEnvironment

SHARED_OPTIONS = ["--host", "--port", "--api-keys-file", "--max-body-mib"]
SERVE_OPTIONS = [
    "--model",
    "--block-size",
    "--kv-memory-mib",
    "--max-batch-tokens",
    "--queue-limit",
    "--attention-backend",
    "--cache-dir",
    "--load-cache",
    "--generation-config",
]
ROUTE_OPTIONS = [
    "--upstream",
    "--load-factor",
    "--min-load",
    "--upstream-api-key",
    "--upstream-timeout",
]


def help_of(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache.sidecar.cli", *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_help_explains_every_option() -> None:
    out = help_of("serve")
    for option in SHARED_OPTIONS + SERVE_OPTIONS:
        assert option in out
    routed = help_of("route")
    for option in SHARED_OPTIONS + ROUTE_OPTIONS:
        assert option in routed
    top = help_of()
    assert "serve" in top
    assert "route" in top


def test_each_command_has_only_its_own_options() -> None:
    serve_help, route_help = help_of("serve"), help_of("route")
    assert "--routing" not in serve_help and "--upstream-timeout" not in serve_help
    assert "--model" not in route_help and "--kv-memory-mib" not in route_help
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "hash"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["route", "--upstream", "http://u/v1", "--model", "demo"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["route"])  # at least one --upstream


def test_serve_upstream_says_it_is_deprecated() -> None:
    """The old spelling still parses every option it took (the engine's too) and says what
    to use instead; here it stops at an invalid value, after the message."""
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--upstream", "http://u/v1"]
    done = subprocess.run(
        [*cmd, "--model", "demo", "--routing", "nope"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "deprecated" in done.stderr and "prefixcache route" in done.stderr
    assert "--routing: invalid choice" in done.stderr


def test_parser_maps_options() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "demo", "--port", "9001", "--block-size", "32", "--queue-limit", "7"]
    )
    assert (args.model, args.port, args.block_size, args.queue_limit) == ("demo", 9001, 32, 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "magic"])


def test_vllms_names_of_shared_options_parse() -> None:
    """A vLLM command line's spelling of the options both servers have."""
    args = build_parser().parse_args(
        ["serve", "--max-num-batched-tokens", "512", "--enable-prefix-caching"]
    )
    assert (args.max_batch_tokens, args.no_prefix_caching) == (512, False)
    assert build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).no_prefix_caching


def test_an_unknown_kv_cache_dtype_is_refused_with_the_names_it_takes() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        serve(build_parser().parse_args(["serve", "--kv-cache-dtype", "int3"]))


def test_load_cache_needs_a_cache_dir() -> None:
    with pytest.raises(SystemExit, match="--load-cache needs --cache-dir"):
        serve(build_parser().parse_args(["serve", "--load-cache", "pinned"]))


def test_one_tenant_keeps_its_namespace_across_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without keys the namespace secret is fixed, so loaded prefixes hit after a restart;
    with keys it is random per start unless --secret-file or $PREFIXCACHE_SECRET sets it."""
    monkeypatch.delenv("PREFIXCACHE_SECRET", raising=False)
    assert read_secret(None, keys_enabled=False) == read_secret(None, keys_enabled=False)
    assert read_secret(None, keys_enabled=True) != read_secret(None, keys_enabled=True)
    monkeypatch.setenv("PREFIXCACHE_SECRET", "from the environment")
    assert read_secret(None, keys_enabled=True) == b"from the environment"


def test_environment_variables_are_read_in_one_place() -> None:
    environ = {"PREFIXCACHE_SECRET": "s" * 16, "PREFIXCACHE_UPSTREAM_API_KEY": "sk-up"}
    assert SidecarEnvironment.read(environ) == SidecarEnvironment(b"s" * 16, "sk-up")
    empty = {"PREFIXCACHE_SECRET": "", "PREFIXCACHE_UPSTREAM_API_KEY": ""}
    assert SidecarEnvironment.read(empty) == SidecarEnvironment()  # empty counts as unset
    given = SidecarEnvironment(secret=b"given" * 4)
    assert read_secret(None, keys_enabled=True, environment=given) == b"given" * 4


def launch(
    *options: str,
    timeout: float = 120,
    command: str = "serve",
    log: IO[bytes] | None = None,
    session: bool = False,
) -> tuple[subprocess.Popen, str]:
    """`prefixcache COMMAND OPTIONS` as a subprocess on a free port, and its root URL, once
    healthy; ``log`` takes its stdout and stderr; ``session``: in a process group of its own."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", command, "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, *options], env=env, stdout=log, stderr=log, start_new_session=session
    )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{root}/health").status_code == 200:
                return proc, root
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not become healthy (exit {proc.poll()})")
        time.sleep(0.1)


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc; [] elsewhere)."""
    kids = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields and int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry.name))
    return kids


def is_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"  # a zombie has exited


def _stat_fields(pid: int) -> list[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rpartition(")")[2].split()  # state, ppid, ... (the name may hold spaces)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@contextlib.contextmanager
def cli_server(*options: str, timeout: float = 120, command: str = "serve") -> Iterator[str]:
    """`prefixcache COMMAND OPTIONS`'s root URL once healthy; stopped with SIGINT, which must
    exit 0 and leave no child process (the engine core) behind."""
    proc, root = launch(*options, timeout=timeout, command=command)
    kids = children_of(proc.pid)
    try:
        yield root
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0  # hang bounds, generous for a loaded box
        assert wait_gone(kids, 60) == []


@pytest.mark.slow
def test_serve_subprocess_answers_and_stops_on_sigint() -> None:
    options = ("--model", "demo", "--num-blocks", "128", "--log-level", "warning")
    with cli_server(*options) as root:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_build_kernels_builds_what_serve_would_load_and_exits() -> None:
    """``serve --build-kernels`` reports each CPU kernel library the server would load (built,
    found, or off with its reason) and exits 0 without loading the model (none exists here)."""
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--build-kernels"]
    cmd += ["--model", "/nonexistent/model", "--log-level", "info", "--gguf-weights", "quantized"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPU kernels ready in" in done.stdout
    # the AVX-512 GEMM too where AMX is absent (it was asked for only through AMX's), and the
    # block GEMM that --gguf-weights quantized runs
    labels = ("CPU layer ops", "CPU GEMM (", "CPU call replay", "batch-invariant attention")
    for label in (*labels, "quantized GEMM"):
        assert label in done.stderr, (label, done.stderr[-2000:])
    assert "not found" not in done.stderr  # the model was never looked for


def test_no_admin_key_in_the_log_after_a_dashboard_session(tmp_path: Path) -> None:
    """The server's own log (uvicorn's access log on) after what the cache page does, and an
    old bookmark of /dashboard?key=...: the admin key appears nowhere."""
    admin = "sk-ops-dashboard-0123456789"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": admin, "tenant": "ops", "admin": True}]}))
    log_path = tmp_path / "server.log"
    options = ("--model", "demo", "--engine", "thread", "--num-blocks", "64")
    with log_path.open("wb") as log:
        proc, root = launch(*options, "--api-keys-file", str(keys), "--log-level", "info", log=log)
        try:
            header = {"Authorization": f"Bearer {admin}"}
            assert httpx.get(f"{root}/dashboard").status_code == 200  # the page asks for it
            assert httpx.get(f"{root}/v1/cache/tree", headers=header).status_code == 200
            with httpx.stream("GET", f"{root}/v1/cache/live?interval=0.2", headers=header) as res:
                assert res.status_code == 200
                assert any(line.startswith("data: ") for line in res.iter_lines())
            old = httpx.get(f"{root}/dashboard", params={"key": admin})  # an old bookmark
            assert old.status_code == 200
            refused = httpx.get(f"{root}/v1/cache/tree", params={"key": admin, "x": "1"})
            assert refused.status_code == 401  # a key in a URL is no key
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
    text = log_path.read_text(encoding="utf-8", errors="replace")
    assert '"GET /dashboard HTTP/1.1" 200' in text  # the access log was on
    assert '"GET /dashboard?key=[redacted] HTTP/1.1" 200' in text
    assert '"GET /v1/cache/tree?key=[redacted]&x=1 HTTP/1.1" 401' in text
    assert admin not in text


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("end", ["SIGTERM", "SIGKILL"])
def test_the_engine_core_is_a_child_that_ends_with_the_server(end: str) -> None:
    """The default mode: the model (torch) lives in one child process, the server holds none;
    a server stopped (SIGTERM) or killed (SIGKILL: no clean-up at all) leaves no core behind."""
    proc, root = launch("--model", "demo", "--num-blocks", "64", "--log-level", "warning")
    try:
        kids = children_of(proc.pid)
        cores = [k for k in kids if "libtorch" in Path(f"/proc/{k}/maps").read_text()]
        assert len(cores) == 1, kids
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        body = {"prompt": "once upon a time", "max_tokens": 2}
        assert httpx.post(f"{root}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(getattr(signal, end))
        # uvicorn shuts down on SIGTERM, then re-raises it: the exit status says SIGTERM
        # the waits bound hangs only (a server or a core that never ends): generous for a
        # loaded box, where a process's clean-up can take seconds
        assert proc.wait(timeout=60) == -getattr(signal, end)
        assert wait_gone(kids, 60) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups (POSIX)")
def test_sigterm_to_the_whole_group_is_a_clean_stop(tmp_path: Path) -> None:
    """systemd's default KillMode signals every process of the service: the core waits for
    the server's Shutdown (after its graceful drain) instead of stopping at once, so a
    request in flight finishes and no error is logged."""
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc, root = launch(
            "--model", "demo", "--num-blocks", "64", "--log-level", "info", log=log, session=True
        )
        try:
            body = {"prompt": "once upon a time", "max_tokens": 2}
            assert httpx.post(f"{root}/v1/completions", json=body, timeout=60).status_code == 200
            kids = children_of(proc.pid)
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == -signal.SIGTERM
            assert wait_gone(kids, 60) == []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    assert "ERROR" not in text and "Traceback" not in text, text


def test_the_default_engine_mode_is_a_process() -> None:
    assert build_parser().parse_args(["serve"]).engine == "process"
    assert build_parser().parse_args(["serve", "--engine", "thread"]).engine == "thread"


@pytest.mark.parametrize("command", ["route", "serve"])  # serve --upstream: the old spelling
def test_route_routes_to_another_server(fake_server: Server, command: str) -> None:
    """`prefixcache route --upstream URL`: no engine here, the fake sidecar answers."""
    options = ("--upstream", fake_server.url, "--log-level", "warning")
    with cli_server(*options, timeout=120, command=command) as root:  # start-up: a hang bound
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(f"{root}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "fake"  # answered by the upstream
        metrics = httpx.get(f"{root}/metrics").text
        series = (
            f'prefixcache:upstream_requests_total{{route="affinity",upstream="{fake_server.url}"}}'
        )
        assert f"{series} 1.0" in metrics


@pytest.mark.parametrize("engine", ["process", "thread"])
@pytest.mark.parametrize("broken", ["missing", "bad-config"])
def test_a_model_that_cannot_load_ends_the_process(
    tmp_path: Path, broken: str, engine: str
) -> None:
    """No zombie server answering 503 forever: exit 1 with the error in one clear line on
    stderr (in process mode it read twice, with two tracebacks, the core's and the server's)."""
    model = tmp_path / "typo"
    if broken == "bad-config":
        model.mkdir()
        (model / "config.json").write_text("{not json")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--port", str(port)]
    proc = subprocess.run(
        [*cmd, "--model", str(model), "--engine", engine, "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=180,  # the old code never exited: TimeoutExpired (a loaded box starts slowly)
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("prefixcache serve: the engine failed to start: "), line
    assert line.count("failed to start") == 1 and "Error:" not in line, line
    if broken == "missing":
        assert f"model {str(model)!r} not found" in line
    else:
        assert f"{model / 'config.json'}: invalid JSON" in line


@pytest.mark.parametrize(
    "entry",
    [
        "from prefixcache.sidecar.cli import main\nmain()\n",  # the console script
        "import runpy\nrunpy.run_module('prefixcache.sidecar.cli', run_name='__main__')\n",
    ],
    ids=["console-script", "python-m"],
)
@pytest.mark.parametrize("argv", [["serve"], ["--help"], ["serve", "--help"]])
def test_without_the_server_extras_the_command_says_what_to_install(
    entry: str, argv: list[str]
) -> None:
    """`pip install prefixcache` (the SDK alone) installs the console script too: run without
    starlette it (or ``python -m prefixcache.sidecar.cli``) names the missing piece and the
    extra, instead of a traceback; its help shows as it is (it needs none of them)."""
    blocked = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn', 'torch'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import prefixcache.sidecar\n"  # the package itself imports none of them
        f"sys.argv = ['prefixcache', *{argv!r}]\n" + entry
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in done.stderr
    if "--help" in argv:
        assert done.returncode == 0 and done.stdout.startswith("usage: prefixcache"), done.stderr
        return
    assert done.returncode == 1, done.stderr
    assert "pip install 'prefixcache[serve]'" in done.stderr


def test_load_cache_with_keys_and_a_random_secret_is_refused_at_start(tmp_path: Path) -> None:
    """With keys and no --secret-file the secret is random per start, and cache files are
    signed with a key derived from it: such a --load-cache can never succeed (it failed later,
    as "checksum mismatch: the file is damaged"). One line, exit 1, no model loaded."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-a-0123456789abcdef", "tenant": "a"}]}))
    cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--model", "/nonexistent"]
    cmd += ["--api-keys-file", str(keys), "--cache-dir", str(tmp_path), "--load-cache", "x"]
    env = {k: v for k, v in os.environ.items() if k != "PREFIXCACHE_SECRET"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--load-cache with --api-keys-file needs --secret-file" in done.stderr
    assert "not found" not in done.stderr  # the model was never looked for


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--port", "-1"],
        ["route", "--upstream", "http://u/v1", "--port", "65536"],
        ["serve", "--num-blocks", "0"],
        ["serve", "--max-model-len", "0"],
    ],
)
def test_out_of_range_numbers_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--port 99999 started ("running on :99999"); --num-blocks 0 and --max-model-len 0 took
    the defaults silently."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    assert "out of range" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--port", "0"]).port == 0  # any free port


def test_a_port_in_use_is_one_line_before_the_model_loads() -> None:
    """uvicorn binds after the app's start-up: the model loaded, then the process exited 3
    with the bind error in the middle of its log."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "prefixcache.sidecar.cli", "serve", "--port", str(port)]
        cmd += ["--model", "/nonexistent/model"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"prefixcache serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "not found" not in done.stderr  # the model was never looked for


def test_the_listen_url_names_the_bound_port() -> None:
    """The "listening on" line (uvicorn's own does not come for a socket it was given) names
    the port bound, the free one where --port 0 asked for any, and an IPv6 host bracketed."""
    with contextlib.closing(listen("127.0.0.1", 0)) as sock:
        assert listen_url(sock) == f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        v6 = listen("::1", 0)
    except SystemExit:
        pytest.skip("no IPv6 loopback here")
    with contextlib.closing(v6):
        assert listen_url(v6) == f"http://[::1]:{v6.getsockname()[1]}"


def test_a_stop_drains_then_aborts_what_is_left() -> None:
    """At a stop the requests in flight get uvicorn's graceful wait less a second; then
    ``abort_all`` ends them (an error event and [DONE], not a connection cut mid-chunk when
    uvicorn cancels them); a second signal schedules nothing more."""
    from prefixcache.sidecar.cli.serve_command import SHUTTING_DOWN, drain_on_exit

    class Server:
        should_exit = False

        def handle_exit(self, sig: int, frame: object) -> None:
            self.should_exit = True

    class Engine:
        def __init__(self) -> None:
            self.calls: list[tuple[float, str]] = []

        def abort_all(self, message: str) -> int:
            self.calls.append((time.monotonic(), message))
            return 1

    async def stop() -> tuple[float, Engine, Server]:
        server, engine = Server(), Engine()
        drain_on_exit(server, engine, graceful_s=1.3)
        began = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)  # as the signal lands on the loop's thread
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(1.0)
        return began, engine, server

    began, engine, server = asyncio.run(stop())
    assert server.should_exit
    assert [message for _, message in engine.calls] == [SHUTTING_DOWN]
    assert engine.calls[0][0] - began >= 0.3


def test_access_lines_end_with_the_request_id(tmp_path: Path) -> None:
    """The id a response carries (x-request-id: the caller's own, or one made here) ends its
    access line, so a client's error report meets the server's log."""
    log_path = tmp_path / "server.log"
    options = ("--model", "demo", "--engine", "thread", "--num-blocks", "64")
    with log_path.open("wb") as log:
        proc, root = launch(*options, "--log-level", "info", log=log)
        try:
            body = {"prompt": "once upon a time", "max_tokens": 2}
            given = httpx.post(
                f"{root}/v1/completions", json=body, headers={"x-request-id": "trace-abc-123"}
            )
            made = httpx.post(f"{root}/v1/completions", json=body)
            assert given.headers["x-request-id"] == "trace-abc-123"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    assert f"INFO prefixcache.sidecar: listening on {root}\n" in text, text[:2000]
    assert '"POST /v1/completions HTTP/1.1" 200 OK trace-abc-123' in text, text[-2000:]
    assert f'"POST /v1/completions HTTP/1.1" 200 OK {made.headers["x-request-id"]}' in text
