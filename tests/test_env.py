"""Hardware facts and the doctor report."""

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from launch_path import machine_problems

import ddplab
from ddplab import env as ddenv


def test_free_port_is_free_and_a_bound_port_is_not():
    port = ddenv.free_port()
    assert ddenv.port_is_free(port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ddenv.port_is_free(sock.getsockname()[1])


def gpus_and_torch() -> tuple[int, str]:
    """The CUDA GPUs torch sees on this machine and its version, asked in a process of its own
    (not ddplab's: ``fake_gpus.py``'s first answer, before it patches anything)."""
    here = _fake_gpus()[0]
    return here["gpus"], here["torch"]


def gpus_here() -> int:
    """The CUDA GPUs torch sees on this machine (see ``gpus_and_torch``)."""
    return gpus_and_torch()[0]


def test_doctor_reports_the_gpus_of_this_machine(capsys):
    gpus = gpus_here()
    report = ddplab.doctor(full=True)
    out = capsys.readouterr().out
    assert report["gpu_count"] == gpus and len(report["gpus"]) == gpus
    assert report["backend"] == ddenv.course_backend(report)   # the course's runs' backend
    assert report["backends"]["gloo"] is True
    assert f"GPUs                 {gpus}: " in out


def test_a_notebooks_doctor_cell_prints_one_line_and_every_problem(capsys):
    report = ddplab.doctor()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * len(report["problems"])   # each problem: itself, its fix
    assert report["torch"] in lines[0] and report["plan"] in lines[0]
    assert "doctor(full=True)" in lines[0]
    ddplab.doctor(quiet=True)
    assert capsys.readouterr().out == ""


def test_doctor_import_and_warm_launches_leave_torch_and_cuda_out_of_the_caller():
    plain = str(Path(__file__).parent / "scripts" / "plain.py")
    code = ("import sys, ddplab; ddplab.doctor(quiet=True)\n"
            f"for _ in range(2): ddplab.launch({plain!r}, 2, quiet=True).check()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "False"  # so CUDA cannot be initialised there either


def test_the_probe_is_kept_on_disk_per_key_and_asked_again_when_the_key_changes(
        tmp_path, monkeypatch):
    """A new kernel reads the facts from the cache file (no torch import, no subprocess); a
    changed variable of the key (here OMP_NUM_THREADS, which changes torch's thread count) asks
    torch again; a damaged file is asked again too."""
    monkeypatch.setenv("DDPLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(ddenv, "_PROBE", None)
    ddenv.cache_file().write_text("{not json")
    facts = ddenv.probe()
    assert facts["threads"] == 2 and facts["torch"].startswith(gpus_and_torch()[1])
    kept = json.loads(ddenv.cache_file().read_text())
    assert kept == {"key": ddenv.cache_key(), "facts": facts}

    kept["facts"]["torch"] = "0.0.0-kept"     # what only the file says: read, not asked
    ddenv.cache_file().write_text(json.dumps(kept))
    code = "import sys, ddplab.env as e; print(e.probe()['torch'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.split() == ["0.0.0-kept", "False"]

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    facts = ddenv.probe()
    assert facts["threads"] == 1 and facts["torch"] != "0.0.0-kept"
    assert json.loads(ddenv.cache_file().read_text())["key"]["environment"]["OMP_NUM_THREADS"] \
        == "1"


def test_another_torch_on_the_path_changes_the_key(tmp_path, monkeypatch):
    """A torch installed elsewhere, or upgraded, is another key: its version or file differs."""
    before = ddenv.cache_key()
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "torch-0.1.dist-info").mkdir()
    (tmp_path / "torch-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    after = ddenv.cache_key()
    assert after["torch"][0] == "0.1" and after["torch"] != before["torch"]
    assert {k: v for k, v in after.items() if k != "torch"} == \
        {k: v for k, v in before.items() if k != "torch"}


def test_problems_name_their_fix(monkeypatch):
    facts = {"backends": {"gloo": True, "nccl": False}, "gpu_count": 0,
             "shm_bytes": 64 * 2**20, "start_method": "fork"}
    monkeypatch.setenv("DDPLAB_BACKEND", "nccl")
    found = dict(ddenv.problems(facts))
    assert any("nccl requested" in p for p in found)
    assert any("--shm-size" in fix for fix in found.values())
    facts.update(gpu_count=2, shm_bytes=2**32)
    monkeypatch.delenv("DDPLAB_BACKEND")
    assert [p for p, _ in machine_problems(ddenv.problems(facts))] == [
        "GPUs present but nccl is unavailable"]


@pytest.mark.parametrize("setting, expected", [
    ({}, "fork from a helper"),
    ({"DDPLAB_LAUNCH_PATH": "subprocess"}, "cold torchrun subprocess"),
])
def test_doctor_says_how_launches_start_here(monkeypatch, setting, expected):
    """The same rule as the launcher's: the doctor's row, and a problem with its fix off the
    fork path."""
    monkeypatch.delenv("DDPLAB_LAUNCH_PATH", raising=False)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    assert ddenv.launch_path().startswith(expected)
    facts = {"backends": {"gloo": True}, "gpu_count": 0, "shm_bytes": 2**32,
             "start_method": "fork"}
    found = dict(ddenv.problems(facts))
    about = {p: fix for p, fix in found.items() if p.startswith("launches cannot fork")}
    if not setting:
        assert about == {}
    else:
        assert len(about) == 1 and "DDPLAB_LAUNCH_PATH=subprocess" in next(iter(about))
        assert "nothing to fix" in next(iter(about.values()))


FAKE_GPUS = str(Path(__file__).parent / "scripts" / "fake_gpus.py")


#: Every machine the tests below fake: (GPUs, peer access, nccl in the build, environment).
MACHINES = [dict(gpus=0), dict(gpus=1), dict(gpus=2, p2p=True), dict(gpus=2, p2p=False),
            dict(gpus=2, p2p=False, env={"NCCL_P2P_DISABLE": "1"}), dict(gpus=2, nccl=False),
            dict(gpus=4, env={"DDPLAB_BACKEND": "gloo"})]


@functools.cache
def _fake_gpus() -> list[dict]:
    """What ``fake_gpus.py`` prints, in one process of its own: this machine's GPUs and torch,
    then what it finds on each of ``MACHINES``."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("DDPLAB_BACKEND", "NCCL_P2P_DISABLE")}
    out = subprocess.run([sys.executable, FAKE_GPUS, json.dumps(MACHINES)], capture_output=True,
                         text=True, timeout=300, env=environ)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(MACHINES) - 1:]]


def _decisions() -> list[dict]:
    return _fake_gpus()[1:]


def decide(extra_env=None, **spec):
    """The doctor's plan and problems (the machine's: ``machine_problems``), and dist's
    choices, with torch.cuda patched elsewhere. Whatever the machine, the doctor's backend is
    the one the ranks pick (one rule)."""
    machine = {**spec, **({"env": extra_env} if extra_env else {})}
    assert machine in MACHINES, f"add {machine} to MACHINES"
    seen = _decisions()[MACHINES.index(machine)]
    assert seen["doctor"]["backend"] == seen["backend"], seen
    assert seen["doctor"]["plan"] == seen["plan"] and f"with {seen['backend']}" in seen["plan"]
    return {**seen, "problems": machine_problems(seen["problems"])}


def test_no_gpu_two_ranks_on_cpu_with_gloo():
    seen = decide(gpus=0)
    assert seen["plan"] == "2 ranks on CPU with gloo (no GPU here)"
    assert (seen["backend"], seen["devices"], seen["single"]) == ("gloo", ["cpu", "cpu"], "cpu")


def test_one_gpu_two_ranks_on_cpu_beside_it_and_one_process_on_the_gpu():
    seen = decide(gpus=1)
    assert seen["plan"].startswith("2 ranks on CPU with gloo (beside 1 GPU")
    assert (seen["backend"], seen["devices"]) == ("gloo", ["cpu", "cpu"])
    assert seen["single"] == "cuda:0"
    assert seen["facts"]["p2p"] is None and not seen["problems"]


def test_two_gpus_with_peer_access_one_nccl_rank_per_gpu():
    seen = decide(gpus=2, p2p=True)
    assert seen["plan"] == "2 ranks with nccl, one per GPU"
    assert (seen["backend"], seen["devices"]) == ("nccl", ["cuda:0", "cuda:1"])
    assert not seen["problems"]


def test_two_consumer_gpus_without_peer_access_name_nccl_p2p_disable():
    seen = decide(gpus=2, p2p=False)
    assert seen["facts"]["p2p"] is False
    assert "NCCL_P2P_DISABLE=1" in seen["plan"]
    [(problem, fix)] = seen["problems"]
    assert "peer-to-peer" in problem and "NCCL_P2P_DISABLE=1" in fix
    settled = decide({"NCCL_P2P_DISABLE": "1"}, gpus=2, p2p=False)
    assert not settled["problems"] and settled["plan"].endswith("(NCCL_P2P_DISABLE=1)")
    assert settled["backend"] == "nccl"


def test_gpus_without_nccl_or_with_gloo_forced_run_on_cpu():
    windows = decide(gpus=2, nccl=False)  # a torch build without nccl, as on Windows
    assert windows["plan"] == "2 ranks on CPU with gloo (this torch build has no nccl)"
    assert (windows["backend"], windows["devices"]) == ("gloo", ["cpu", "cpu"])
    assert windows["single"] == "cuda:0"
    forced = decide({"DDPLAB_BACKEND": "gloo"}, gpus=4)
    assert forced["plan"] == "4 ranks on CPU with gloo (DDPLAB_BACKEND=gloo)"
    assert forced["backend"] == "gloo" and set(forced["devices"]) == {"cpu"}


def test_doctor_prints_the_plan_in_one_line(capsys):
    """The plan for this machine's GPUs (each GPU count's plan is checked above, faked)."""
    gpus = gpus_here()
    report = ddplab.doctor(full=True)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("lessons run ")]
    assert lines == [f"lessons run          {report['plan']}"]
    if gpus == 0:
        assert report["plan"] == "2 ranks on CPU with gloo (no GPU here)"
    else:
        assert report["plan"].startswith(f"{max(2, gpus)} ranks ")
        assert ("with nccl" in report["plan"]) == (gpus >= 2 and report["backends"]["nccl"]
                                                   and os.environ.get("DDPLAB_BACKEND") != "gloo")
