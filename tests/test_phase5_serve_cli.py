"""`lab serve` as a process: every engine option checked before it listens (one line, exit 2),
SIGTERM exits 143 and SIGINT 130 (while serving, and SIGTERM while loading), and a restart on the
same port works at once (address reuse)."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, clean_env

pytest.importorskip("aiohttp")

SERVE = [sys.executable, "-m", "common.cli", "serve", "--model", "tiny", "--device", "cpu", "--max-model-len", "128",
         "--host", "127.0.0.1"]
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("flags, message", [
    (["--attention-backend", "bogus"], "invalid choice: 'bogus'"),
    (["--attention-backend", "triton"], "attention_backend 'triton' runs a Triton kernel"),
    (["--device", "banana"], "device 'banana': not a device"),
    (["--port", "-1"], "not a TCP port"),
    (["--api-key", " "], "--api-key must not be empty"),
])
def test_bad_engine_options_end_before_listening(flags, message):
    env = clean_env()
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([*SERVE, "--port", "0", *flags], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=READY_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and "ready" not in proc.stdout


def start(port: int, **env) -> subprocess.Popen:
    proc = subprocess.Popen([*SERVE, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=clean_env(**env))
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline and "ready at" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"lab serve exited {proc.returncode}: {proc.stderr.read()}")
    assert "ready at" in line
    return proc


def use(port: int, api_key: str = "x") -> None:
    """One real request with an open keep-alive connection, so the port has a TIME_WAIT behind it."""
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=30)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_exit_codes_and_restart_on_the_same_port(sig, code):
    port = free_port()
    proc = start(port)
    try:
        use(port)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
        assert "stopped" in proc.stderr.read()
        again = start(port, LAB_API_KEY="from-env")          # at once, on the same port
        use(port, api_key="from-env")
        with pytest.raises(Exception, match="401"):
            use(port, api_key="x")
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 143
    finally:
        for p in (proc, locals().get("again")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_while_loading_exits_143(monkeypatch, capsys):
    """A real SIGTERM delivered while the engine loads (in-process: the load sends it to this very
    process, then takes its time) ends `lab serve` with 143 and one line, not 130."""
    from common.cli import main
    from phases.phase5_inference.engine import llm

    def slow_load(self, config, weights=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("SIGTERM did not interrupt the load")
    monkeypatch.setattr(llm.LLMEngine, "__init__", slow_load)
    started = time.monotonic()
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--port", "0"]) == 143
    assert time.monotonic() - started < 20
    assert capsys.readouterr().err.strip() == "lab serve: stopped by SIGTERM"
