"""``launch(..., flight_recorder=True)``: a timed-out launch names the collective each rank waits
in and its sequence number, read live from torch's Flight Recorder (``ddplab.flight_recorder``);
when it cannot be read, the report says why in one line and the timeout is reported as ever."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import threading
import uuid

import pytest
import torch
from test_launch import end_once_said

import ddplab
from ddplab import flight_recorder
from ddplab.lab import postmortem
from ddplab.launcher.results import RunResult

DESYNC = "ddplab.workers.desync"
# The hang needs no clock of its own: rank 0 waits in an all-reduce rank 1 never calls. Each
# rank emits its ``shard`` metric just before the collectives, and ``on_event`` ends the launch
# as a timeout a few seconds after both did (the Flight Recorder is read as after any timeout;
# the real clock is test_launch's and test_rank_behaviour's). HANG_TIMEOUT is a safety net.
HANG_TIMEOUT = 300


def _debug_server() -> bool:
    try:
        from torch.distributed.debug import start_debug_server  # noqa: F401
    except ImportError:
        return False
    return True


needs_debug_server = pytest.mark.skipif(
    not _debug_server(), reason=f"torch {torch.__version__} has no "
    "torch.distributed.debug.start_debug_server, the Flight Recorder's live reader")


def _left_behind(token: str) -> list[str]:
    """The processes whose environment holds ``token`` (each launch below has its own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as env:
                if token.encode() in env.read():
                    found.append(pid)
        except OSError:  # gone, or not ours to read
            pass
    return found


def _hang(**options) -> tuple[RunResult, str]:
    token = uuid.uuid4().hex
    env = {"FLIGHT_RECORDER_TEST": token, **options.pop("env", {})}
    result = ddplab.launch(DESYNC, 2, args=["--fault", "one_rank"], backend="gloo", quiet=True,
                           timeout=HANG_TIMEOUT, flight_recorder=True, env=env, **options,
                           on_event=end_once_said(("shard", 0), ("shard", 1), after=3.0))
    return result, token


def _timed_out(**fields) -> RunResult:
    return RunResult(status="timeout", returncode=124, wall_time=1.0, world_size=2, **fields)


def _report_line(result: RunResult) -> str:
    lines = [line for line in result.error.splitlines() if line.startswith("Flight Recorder")]
    assert len(lines) == 1, result.error
    return lines[0]


@pytest.mark.slow
@needs_debug_server
@pytest.mark.skipif(importlib.util.find_spec("tabulate") is None,
                    reason="tabulate is not installed (make setup installs the lock, which has it)")
def test_a_hung_launch_names_each_ranks_collective_and_its_sequence_number():
    result, token = _hang()
    assert result.status == "timeout" and result.still_running == [0, 1]
    waits = result.waits
    assert (waits[0].op, waits[1].op) == ("all_reduce", "all_gather")   # desync.py's two lines
    assert waits[0].seq == waits[1].seq and not waits[0].finished and not waits[1].finished
    assert flight_recorder.collective_waits(result.records) == waits   # the records it read
    stuck = {rank: postmortem.user_frames(result.stacks[rank].splitlines())[-1].code
             for rank in (0, 1)}
    assert "all_reduce" in stuck[0] and "all_gather" in stuck[1]   # the stacks agree
    line = _report_line(result)
    assert f"rank 0 waits in all_reduce #{waits[0].seq}" in line
    assert f"rank 1 waits in all_gather #{waits[1].seq}" in line and "out of step" in line
    assert json.loads(json.dumps(result.to_dict()))["waits"]["1"]["op"] == "all_gather"  # --json
    assert _left_behind(token) == []   # rank 0's debug server went with the job


@pytest.mark.slow
@needs_debug_server
def test_without_tabulate_the_report_says_so_in_one_line(tmp_path):
    """Rank 0's debug server imports tabulate: hidden here by a module of that name that cannot
    be imported, first on the job's ``PYTHONPATH``."""
    (tmp_path / "tabulate.py").write_text("raise ImportError('tabulate is hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result, token = _hang(env={"PYTHONPATH": path})
    assert result.status == "timeout" and result.waits == {}
    line = _report_line(result)
    assert line.startswith("Flight Recorder not read: rank 0:") and "tabulate" in line
    assert "as on_event asked" in result.error.splitlines()[0]   # the report as ever
    assert _left_behind(token) == []


def test_the_reader_parses_the_page_rank_0_serves():
    """The recorded page of the one_rank hang, served over HTTP as rank 0's server serves it."""
    page = postmortem.recording("flight_recorder_one_rank")["page"].encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (the standard library's name)
            found = self.path == "/fr_trace_json"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(page if found else b"")

        def log_message(self, *args):
            pass

    reader = flight_recorder.Reader()
    assert reader.env == {"TORCH_FR_BUFFER_SIZE": "100", flight_recorder.PORT_ENV: str(reader.port)}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", reader.port), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader.read()
    finally:
        server.shutdown()
        server.server_close()
    assert {rank: str(c) for rank, c in reader.waits.items()} == {0: "all_reduce #1",
                                                                  1: "all_gather #1"}
    timed_out = _timed_out(error="timed out after 1 s")
    reader.report(timed_out)
    assert timed_out.waits == reader.waits
    assert timed_out.records == flight_recorder.debug_server_records(page.decode())   # for dumps
    assert _report_line(timed_out).startswith("Flight Recorder: rank 0 waits in all_reduce #1;")
    finished = RunResult(status="ok", returncode=0, wall_time=1.0, world_size=2)
    reader.report(finished)   # only a timeout is reported
    assert finished.waits == {} and finished.records == {} and finished.error == ""


def test_a_reader_with_nothing_to_read_says_so_in_one_line():
    reader = flight_recorder.Reader()   # a free port: nobody listens there
    reader.read()
    timed_out = _timed_out(error="timed out after 1 s")
    reader.report(timed_out)
    assert timed_out.waits == {} and timed_out.records == {}
    assert timed_out.error.startswith("timed out after 1 s\n")
    line = _report_line(timed_out)
    assert line.startswith("Flight Recorder not read:") and str(reader.port) in line
    said = {"kind": flight_recorder.EVENT, "rank": 0, "error": "rank 0: no tabulate"}
    told = _timed_out(error="timed out", events={0: [said]})
    reader.report(told)   # what a rank said wins over what the fetch saw
    assert _report_line(told) == "Flight Recorder not read: rank 0: no tabulate"


def test_an_mp_spawn_script_is_refused_before_anything_starts():
    with pytest.raises(ddplab.LaunchError, match="engine='torchrun'"):
        ddplab.launch(DESYNC, 2, engine="spawn", flight_recorder=True, quiet=True)
