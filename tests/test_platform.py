"""Every platform-dependent choice of the launcher (``ddplab.env``'s platform section), made
with ``sys.platform`` patched to Linux, macOS and Windows: the code a Mac or a Windows machine
runs is code a test ran. No process is started."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

import pytest

from ddplab import env
from ddplab.launcher import procs
from ddplab.launcher.spec import LaunchSpec

INTERFACES = {"linux": [(1, "lo"), (2, "eth0")], "darwin": [(1, "lo0"), (4, "en0")],
              "win32": []}
LOOPBACK = {"linux": "lo", "darwin": "lo0", "win32": None}


class FakeLibc:
    def __init__(self):
        self.calls = []

    def prctl(self, *args):
        self.calls.append(args)
        return 0


@pytest.fixture(params=["linux", "darwin", "win32"])
def platform(request, monkeypatch):
    """This test as on ``request.param``: its platform name, interfaces and libc (a fake that
    records ``prctl`` calls; off Linux, any call to libc fails the test)."""
    monkeypatch.setattr(sys, "platform", request.param)
    monkeypatch.setattr(socket, "if_nameindex", lambda: INTERFACES[request.param],
                        raising=False)
    libc = FakeLibc()

    def cdll(*_args, **_kwargs):
        assert request.param == "linux", "libc called off Linux"
        return libc
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("DDPLAB_LAUNCH_PATH", raising=False)
    return request.param, libc


def test_a_loopback_job_names_the_loopback_interface_this_platform_has(platform):
    name, _libc = platform
    assert env.loopback_interface() == LOOPBACK[name]
    job_env = LaunchSpec("x.py").job_env()  # a one-node job on 127.0.0.1
    assert job_env.get("GLOO_SOCKET_IFNAME") == LOOPBACK[name]
    remote = LaunchSpec("x.py", master_addr="10.0.0.1")
    remote.host = "10.0.0.1"
    assert "GLOO_SOCKET_IFNAME" not in remote.job_env()  # another host: the user's to choose


def test_a_macos_machine_listing_only_lo_gets_lo(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "en0")], raising=False)
    assert env.loopback_interface() == "lo"
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(2, "en0")], raising=False)
    assert env.loopback_interface() is None


def test_the_users_interface_wins(platform, monkeypatch):
    from ddplab.launcher.jobs import child_env

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert child_env(os.environ, LaunchSpec("x.py").job_env())["GLOO_SOCKET_IFNAME"] == "eth7"


def test_death_signals_and_subreapers_are_asked_of_linux_only(platform):
    name, libc = platform
    env.set_parent_death_signal(signal.SIGTERM)
    assert env.become_subreaper() is (name == "linux")
    assert libc.calls == ([(1, int(signal.SIGTERM), 0, 0, 0), (36, 1, 0, 0, 0)]
                          if name == "linux" else [])


def test_a_subprocess_dies_with_its_parent_through_prctl_on_linux_only(platform):
    name, _libc = platform
    cmd = ["python", "script.py"]
    wrapped = env.dies_with_parent(cmd, signal.SIGTERM)
    if name == "linux":
        assert wrapped[-2:] == cmd and "prctl" in " ".join(wrapped)
        assert str(int(signal.SIGTERM)) in wrapped and str(os.getpid()) in wrapped
    else:
        assert wrapped == cmd


def test_launches_fork_from_the_helper_on_linux_only(platform):
    name, _libc = platform
    why = env.no_fork_reason()
    assert (why is None) is (name == "linux")
    if why is not None:
        assert name in why


def test_the_output_socket_is_abstract_on_linux_and_a_private_file_elsewhere(platform):
    name, _libc = platform
    if not hasattr(socket, "AF_UNIX"):
        pytest.skip("no UNIX sockets on this machine")
    channel, address = procs.rank_channel()
    try:
        if name == "linux":
            assert address.startswith("@ddplab-ranks-")
        else:  # (a path in a private folder, bound here for real)
            assert os.path.isabs(address) and os.path.exists(address)
            assert oct(os.stat(os.path.dirname(address)).st_mode & 0o777) == "0o700"
    finally:
        channel.close()


def test_children_are_read_from_proc_with_or_without_the_kernels_lists(monkeypatch):
    """Where the kernel keeps no ``task/*/children`` lists, the parents in ``/proc`` say it."""
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in env.children(os.getpid())
        monkeypatch.setattr(env.glob, "glob", lambda _pattern: [])
        assert child.pid in env.children(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_cpu_flags_are_the_kernels_list_on_linux_and_unknown_elsewhere(platform, tmp_path):
    name, _libc = platform
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx512f avx512_bf16\n")
    flags = env.cpu_flags(info)
    assert flags == ({"fpu", "avx512f", "avx512_bf16"} if name == "linux" else None)
    assert env.cpu_flags(tmp_path / "absent") is None
