"""Serve an environment app (a FastAPI app factory) on a local port, in a child process.

``EnvironmentServer(app, params, log)`` binds a listening socket on ``127.0.0.1`` at port 0 (the
kernel picks a free one as it binds, so no other program can take it between a choice and the bind)
and starts ``python -m actors.environments.serve`` with it, which loads ``app``
(``package.module:factory``), calls it with ``params`` and serves the result under uvicorn on that
socket. A run whose task says ``serve:`` holds one for its
whole length (``mesh/runtime/run.py``); tests start theirs the same way. The child's output
goes to ``log`` (a pipe nobody reads would fill and block it), and a server that exits or
never answers ``/health`` is reported with the end of that log.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0  # importing openenv (gradio, fastmcp) takes seconds on a busy machine


class ServerFailed(RuntimeError):
    """The environment server exited or never became ready; the message holds its log's end."""


class EnvironmentServer:
    """One served app; ``wait_ready`` before use, ``stop`` (or the ``with`` block's end) after."""

    def __init__(self, app: str, params: dict, log: Path):
        self.app, self.log = app, log
        with socket.create_server(("127.0.0.1", 0)) as listener:  # the child serves on it; this copy closes
            self.port = listener.getsockname()[1]
            command = [sys.executable, "-m", "actors.environments.serve", app, "--fd", str(listener.fileno())]
            command += ["--params", json.dumps(params)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            with log.open("w") as out:
                self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=out, pass_fds=(listener.fileno(),))
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the environment server {self.app} exited ({self.proc.returncode}): {self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise ServerFailed(
            f"the environment server {self.app} did not answer {self.url}/health within {timeout_s:.0f} s: "
            f"{self._tail()}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self) -> str:
        text = self.log.read_text(errors="replace").strip() if self.log.exists() else ""
        return f"the end of its log ({self.log}):\n{text[-2000:]}" if text else f"its log ({self.log}) is empty"


def main() -> None:
    import uvicorn

    from actors import registry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", help="package.module:factory, returning a FastAPI app")
    parser.add_argument("--fd", type=int, required=True, help="a listening socket's file descriptor, to serve on")
    parser.add_argument("--params", default="{}", help="the factory's keyword arguments, as JSON")
    args = parser.parse_args()
    app = registry.load("task", args.app)(**json.loads(args.params))
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[socket.socket(fileno=args.fd)])


if __name__ == "__main__":
    main()
