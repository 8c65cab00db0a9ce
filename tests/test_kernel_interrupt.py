"""A Jupyter interrupt during ddplab.launch, in a real IPython kernel.

The kernel is interrupted the way JupyterLab's stop button does it (``interrupt_kernel``: SIGINT
to the kernel). The launch must end every process of its job, say so, and raise
KeyboardInterrupt again, so that the cell fails like any interrupted cell and "Run All" stops.
"""

from __future__ import annotations

import queue
import re
import sys
import time
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

FAULTY = str(Path(__file__).parent / "scripts" / "faulty.py")


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_interrupted_launch_ends_its_workers_and_fails_the_cell():
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable  # this environment's interpreter, with ddplab
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute(f"import ddplab\nr = ddplab.launch({FAULTY!r}, 2, args=['sleep'], "
                            f"timeout=300)\nprint('not reached')")
        text, deadline = "", time.monotonic() + 180
        while len(re.findall(r"\bpid (\d+)", text)) < 2:
            assert time.monotonic() < deadline, f"the workers did not start:\n{text}"
            try:
                msg = kc.get_iopub_msg(timeout=5)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                text += msg["content"]["text"]
        pids = [int(p) for p in re.findall(r"\bpid (\d+)", text)]
        assert all(running(pid) for pid in pids)

        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=120)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=120)
        content = reply["content"]
        assert content["status"] == "error"
        assert content["ename"] == "KeyboardInterrupt"
        assert "every process of the job was ended" in content["evalue"]
        assert not [pid for pid in pids if running(pid)]  # ended before the error was raised
        # The kernel lives on, and the next launch works.
        outputs: list[dict] = []
        for _ in range(3):  # (ipykernel aborts requests that arrive just after an error)
            again = kc.execute_interactive(
                f"print(ddplab.launch({FAULTY!r}, 2, args=['sysexit0'], quiet=True).status)",
                timeout=180, output_hook=lambda m: outputs.append(m))
            if again["content"]["status"] != "aborted":
                break
        assert again["content"]["status"] == "ok"
        printed = "".join(m["content"].get("text", "") for m in outputs
                          if m["msg_type"] == "stream")
        assert printed.strip() == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
