"""Hardware facts and the doctor report."""

import socket
import subprocess
import sys
from pathlib import Path

import ddplab
from ddplab import env as ddenv


def test_free_port_is_free_and_a_bound_port_is_not():
    port = ddenv.free_port()
    assert ddenv.port_is_free(port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ddenv.port_is_free(sock.getsockname()[1])


def test_doctor_reports(capsys):
    report = ddplab.doctor()
    out = capsys.readouterr().out
    assert report["gpu_count"] == 0 and report["backend"] == "gloo"  # this machine has no GPU
    assert report["backends"]["gloo"] is True
    assert "ddplab will use      gloo" in out


def test_doctor_import_and_warm_launches_leave_torch_and_cuda_out_of_the_caller():
    plain = str(Path(__file__).parent / "scripts" / "plain.py")
    code = ("import sys, ddplab; ddplab.doctor(quiet=True)\n"
            f"for _ in range(2): ddplab.launch({plain!r}, 2, quiet=True).check()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "False"  # so CUDA cannot be initialised there either


def test_problems_name_their_fix(monkeypatch):
    facts = {"backends": {"gloo": True, "nccl": False}, "gpu_count": 0,
             "shm_bytes": 64 * 2**20, "start_method": "fork"}
    monkeypatch.setenv("DDPLAB_BACKEND", "nccl")
    found = dict(ddenv.problems(facts))
    assert any("nccl requested" in p for p in found)
    assert any("--shm-size" in fix for fix in found.values())
    facts.update(gpu_count=2, shm_bytes=2**32)
    monkeypatch.delenv("DDPLAB_BACKEND")
    assert [p for p, _ in ddenv.problems(facts)] == ["GPUs present but nccl is unavailable"]
