"""`sgl_multilora.server.launch` when the HTTP port it chose is taken before the server binds it: the server logs
the bind error and never becomes ready, so the launcher starts it again on another port (a caller's own port is an
error at once). The server here is a stand-in executable given as `python`: it writes uvicorn's bind error the first
time and serves `/health_generate` after that."""

from __future__ import annotations

import sys
import time

import pytest
import requests

from sgl_multilora.server import ServerStartError, free_port, launch

FAKE = f"""#!{sys.executable}
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
marker = os.environ["FAKE_MARKER"]
if not os.path.exists(marker):
    open(marker, "w").write(str(port))
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {{port}}): "
          "address already in use", flush=True)
    time.sleep(120)  # as SGLang: the other processes stay up, the server never answers
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake_python"
    path.write_text(FAKE)
    path.chmod(0o755)
    return str(path)


def test_a_port_taken_before_the_bind_is_retried_on_another(fake_python, tmp_path):
    marker = tmp_path / "first_port"
    start = time.monotonic()
    handle = launch("m", python=fake_python, env={"FAKE_MARKER": str(marker)}, log_path=tmp_path / "log",
                    ready_timeout_s=60)
    try:
        assert time.monotonic() - start < 30  # not the 60 s time-out: the bind error was read from the log
        first = int(marker.read_text())
        assert handle.url != f"http://127.0.0.1:{first}"
        assert requests.get(handle.url + "/health_generate", timeout=10).status_code == 200
    finally:
        handle.stop()
    assert not handle.alive()


def test_the_callers_own_port_taken_is_an_error_at_once(fake_python, tmp_path):
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="was taken before the server could bind it"):
        launch("m", port=free_port(), python=fake_python, env={"FAKE_MARKER": str(tmp_path / "first_port")},
               log_path=tmp_path / "log", ready_timeout_s=60)
    assert time.monotonic() - start < 30
