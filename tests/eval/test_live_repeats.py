"""The harness's repeat protocol against two stand-in servers (no SGLang): arms interleaved with the order
alternating per repeat, every replay on a flushed cache, records tagged with the repeat and the load, and a report
whose setup records the machine, its load and the protocol.

The stand-in speaks the part of SGLang's HTTP API the driver and harness use (`/health`, `/flush_cache`, streaming
`/generate`) and logs every call in one shared, ordered log, so the test sees which server was driven when.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.live import harness
from eval.live.protocol import arm_order

OUTPUT_TOKENS = 3
TRACE = [
    {"arrival_s": 0.0, "adapter": None, "prompt": "one two three", "output_tokens": OUTPUT_TOKENS},
    {"arrival_s": 0.02, "adapter": None, "prompt": "four five", "output_tokens": OUTPUT_TOKENS},
]


class StandIn:
    """A thread serving SGLang's endpoints for arm `name`; `delay_s` before the first token."""

    def __init__(self, name: str, log: list, lock: threading.Lock, delay_s: float):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                stand_in.note(self.path)
                self.send_response(200)
                self.end_headers()
                if self.path != "/generate":
                    return
                time.sleep(delay_s)
                num_prompt = len(body["text"].split())
                for i in range(1, body["sampling_params"]["max_new_tokens"] + 1):
                    meta = {"completion_tokens": i, "prompt_tokens": num_prompt, "cached_tokens": 0}
                    chunk = {"text": " tok" * i, "meta_info": meta}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.name, self.log, self.lock = name, log, lock
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def note(self, path: str) -> None:
        with self.lock:
            self.log.append((self.name, path))


@pytest.fixture
def stand_ins():
    log, lock = [], threading.Lock()
    servers = {"ours": StandIn("ours", log, lock, 0.0), "stock": StandIn("stock", log, lock, 0.05)}
    yield servers, log
    for s in servers.values():
        s.server.shutdown()
        s.server.server_close()


def test_arm_order_alternates_and_balances_positions():
    assert [arm_order(["ours", "stock"], r) for r in range(4)] == [
        ["ours", "stock"], ["stock", "ours"], ["ours", "stock"], ["stock", "ours"]
    ]
    arms = ["a", "b", "c"]
    orders = [arm_order(arms, r) for r in range(3)]
    assert all(sorted(o) == arms for o in orders)  # every arm once per repeat
    for position in range(3):  # over len(arms) repeats, every arm takes every position once
        assert sorted(o[position] for o in orders) == arms


def run_harness(tmp_path, servers, *extra):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in TRACE))
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "manifest.json").write_text(json.dumps({"adapters": []}))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"adapters_dir": str(adapters), "arms": {"ours": {}, "stock": {}}}))
    out = tmp_path / "out"
    args = ["--workload", "trace", "--param", f"path={trace}", "--config", str(config), "--out-dir", str(out)]
    args += ["--url", f"ours={servers['ours'].url}", "--url", f"stock={servers['stock'].url}"]
    args += ["--time-scales", "1,2", "--timeout-s", "30", *extra]
    return harness.main(args), out


def test_harness_interleaves_arms_over_repeats(stand_ins, tmp_path):
    servers, log = stand_ins
    status, out = run_harness(tmp_path, servers)  # --repeats defaults to 3
    assert status == 0

    # The servers' own log, cut at each flush: every replay is a flush then the workload's requests, all on one
    # server; the replays run repeat by repeat, each time scale with both arms, the order alternating per repeat.
    replays = []
    for arm, path in log:
        if path == "/flush_cache":
            replays.append((arm, []))
        else:
            assert replays[-1][0] == arm, f"{arm} got {path} during a replay of {replays[-1][0]}"
            replays[-1][1].append(path)
    assert all(paths == ["/generate"] * len(TRACE) for _, paths in replays), replays
    rep_orders = [["ours", "stock"], ["stock", "ours"], ["ours", "stock"]]
    assert [arm for arm, _ in replays] == [arm for order in rep_orders for _scale in (1, 2) for arm in order]

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == len(TRACE) * 2 * 2 * 3
    assert all(r["error"] is None and r["output_tokens"] == OUTPUT_TOKENS for r in records)
    replay_keys = [(r["extra"]["repeat"], r["extra"]["request_rate"], r["arm"]) for r in records]
    assert [k[0] for k in dict.fromkeys(replay_keys)] == [0] * 4 + [1] * 4 + [2] * 4
    for r in records:
        load = r["extra"]["load_avg"]
        assert len(load) == 3 and all(isinstance(x, float) and x >= 0 for x in load)

    text = (out / "report.md").read_text()
    setup = text.split("| experiment")[0]
    assert "- machine: " in setup and "CPU cores" in setup
    assert "- load average (1 / 5 / 15 min): " in setup and "at the start" in setup and "at the end" in setup
    assert "3 repeats x time scales 1, 2" in setup and "rep 0: ours, stock; rep 1: stock, ours" in setup
    assert "each replay on a flushed prefix cache" in setup
    # per arm and rate (the trace offers 50 req/s; time scale 2 doubles it): 3 repeats of 2 requests each, and one
    # ratio row per rate taken over the 3 repeats
    for arm in ("ours", "stock"):
        for rate in (50, 100):
            assert f"| trace | {arm} | {rate} | 3 | 6 | 0 |" in text
    assert "| trace | 50 | ours | stock | 3 |" in text and "| trace | 100 | ours | stock | 3 |" in text


def test_unreachable_arm_stops_the_run_and_the_report_still_renders(stand_ins, tmp_path, capsys):
    servers, _ = stand_ins
    servers["stock"].server.shutdown()
    servers["stock"].server.server_close()
    status, out = run_harness(tmp_path, servers, "--repeats", "2")
    assert status == 1
    assert f"cannot reach the server for arm 'stock' at {servers['stock'].url}" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # rep 0 at time scale 1 runs ours, then stock is unreachable: nothing after it runs
    assert {(r["arm"], r["extra"]["repeat"]) for r in records} == {("ours", 0)}
    assert "| trace | ours | " in (out / "report.md").read_text()
