"""Commands for real clusters: a SLURM batch script, and the per-node commands of a manual run.

``ddplab/templates/slurm.sbatch`` is a complete batch script that can be submitted unchanged
(2 nodes x 4 GPUs); ``render`` returns it with other values filled in::

    from ddplab.lab import slurm
    job = ["--dataset", "cifar10", "--model", "resnet18", "--epochs", "10",
           "--scale-lr", "--warmup-epochs", "1"]   # replaces the template's arguments whole
    print(slurm.render(nodes=4, gpus_per_node=8, target_args=job))

    python -m ddplab.lab.slurm --nodes 4 --gpus-per-node 8 -- --dataset cifar10 \\
        --model resnet18 --epochs 10 --scale-lr --warmup-epochs 1 > job.sbatch
    sbatch job.sbatch

``node_commands`` gives what to type on each machine when there is no scheduler;
``group_ranks`` runs torch's c10d rendezvous for agents that name their own address
(torchrun's ``--local-addr``) and returns the node number each got.

Lesson: 07b.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "slurm.sbatch"
DEFAULT_PORT = 29500


def template() -> str:
    """The batch script exactly as shipped (valid to submit as it is)."""
    return TEMPLATE.read_text()


def _substitute(text: str, pattern: str, value: str, count: int = 1) -> str:
    """Replace group 2 of ``pattern`` (a multiline regex) by ``value``; insist it matched."""
    new, found = re.subn(pattern, lambda m: m.group(1) + value + m.group(3), text, flags=re.M)
    if found < count:
        raise ValueError(f"the SLURM template no longer contains {pattern!r}: restore "
                         f"{TEMPLATE} from git, or update ddplab/lab/slurm.py to match it.")
    return new


def render(
    nodes: int = 2,
    gpus_per_node: int = 4,
    *,
    target: str = "ddplab.workers.train",
    target_args: Optional[Sequence[str]] = None,
    cpus_per_task: int = 16,
    time: str = "00:30:00",
    job_name: str = "ddplab",
    partition: Optional[str] = None,
    port: int = DEFAULT_PORT,
) -> str:
    """Return the batch script with these values (the defaults reproduce the template).

    Args:
        nodes: machines to allocate (``#SBATCH --nodes``; torchrun gets ``$SLURM_NNODES``).
        gpus_per_node: GPUs per machine = workers per machine (``--nproc-per-node``).
        target: the module every worker runs (or a ``.py`` path).
        target_args: its command-line arguments (default: the template's).
        cpus_per_task: CPU cores for the one task (torchrun agent) on each node.
        time: wall-clock limit, ``HH:MM:SS``.
        job_name: the job's name in the queue and in the log file name.
        partition: the partition (queue) to submit to; None leaves the cluster's default.
        port: rendezvous port on the first node.

    Raises:
        ValueError: a value SLURM or torchrun would reject (the message says which).
    """
    _validate(nodes, gpus_per_node, cpus_per_task, time, port)
    text = template()
    sb = r"^(#SBATCH --{}=)({})(\s*)$"
    text = _substitute(text, sb.format("job-name", r"\S+"), job_name)
    text = _substitute(text, sb.format("nodes", r"\d+"), str(nodes))
    text = _substitute(text, sb.format("gres", r"gpu:\d+"), f"gpu:{gpus_per_node}")
    text = _substitute(text, sb.format("cpus-per-task", r"\d+"), str(cpus_per_task))
    text = _substitute(text, sb.format("time", r"\S+"), time)
    text = _substitute(text, r"^(GPUS_PER_NODE=)(\d+)(\s)", str(gpus_per_node))
    text = _substitute(text, r'^(TARGET=)("[^"]*")(\s)', _double_quoted(target))
    if target_args is not None:
        text = _substitute(text, r"^(TARGET_ARGS=)(\(.*\))(\s*)$",
                           "(" + " ".join(shlex.quote(str(a)) for a in target_args) + ")")
    text = _substitute(text, r"(\$head_node:)(\d+)(\b)", str(port), count=2)
    if target.endswith(".py"):
        text = text.replace('-m "$TARGET"', '"$TARGET"')
    if partition:
        text = text.replace("#SBATCH --nodes=", f"#SBATCH --partition={partition}\n"
                            "#SBATCH --nodes=", 1)
    return text


def _double_quoted(text: str) -> str:
    """``text`` as a bash double-quoted word (``$``, backquotes and quotes escaped)."""
    return '"' + re.sub(r'([\\"$`])', r"\\\1", text) + '"'


def _validate(nodes: int, gpus_per_node: int, cpus_per_task: int, time: str, port: int) -> None:
    if nodes < 1 or gpus_per_node < 1 or cpus_per_task < 1:
        raise ValueError("nodes, gpus_per_node and cpus_per_task must be at least 1 (for a "
                         "CPU-only cluster, drop the --gres line from the rendered script).")
    if not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){1,2}", time):
        raise ValueError(f"time={time!r}: write it as HH:MM:SS (or D-HH:MM:SS), e.g. 01:00:00.")
    if not 1024 <= port < 65536:
        raise ValueError(f"port={port}: pick an unprivileged port, 1024..65535 (e.g. 29500).")


def torchrun_line(script: str) -> str:
    """The torchrun command of a batch script, continuation lines joined into one line."""
    joined = re.sub(r"\\\n\s*", "", script)
    for line in joined.splitlines():
        if line.strip().startswith(("srun torchrun", "torchrun")):
            return " ".join(line.split())
    raise ValueError("no torchrun command in this script")


def node_commands(
    target: str,
    target_args: Sequence[str] = (),
    *,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    endpoint: str = f"127.0.0.1:{DEFAULT_PORT}",
    tool: str = "ddplab",
) -> list[str]:
    """The command to type on each machine of a manual multi-node run, node 0 first.

    With torchrun every machine runs the very same command: the c10d rendezvous numbers the
    nodes and ignores ``--node-rank``, so it is left out. ddplab's command differs only in
    ``--node-rank``, which marks the launcher that hosts the rendezvous store. ``endpoint`` is
    node 0's address as the other machines reach it (127.0.0.1 only when all "nodes" are this
    machine).

    Args:
        target: module the workers run.
        target_args: its arguments.
        nnodes: number of machines.
        nproc_per_node: workers per machine (GPUs per machine).
        endpoint: ``HOST:PORT`` of the rendezvous on node 0.
        tool: ``"ddplab"`` (``python -m ddplab launch``) or ``"torchrun"``.

    Lesson: 07b.
    """
    if tool not in ("ddplab", "torchrun"):
        raise ValueError(f"tool={tool!r}: use 'ddplab' or 'torchrun'.")
    rest = " ".join(shlex.quote(str(a)) for a in [target, *target_args])
    commands = []
    for node in range(nnodes):
        if tool == "ddplab":
            head = (f"python -m ddplab launch --nnodes {nnodes} --node-rank {node} "
                    f"--nproc-per-node {nproc_per_node} --rdzv-endpoint {endpoint}")
        else:
            head = (f"torchrun --nnodes {nnodes} --nproc-per-node "
                    f"{nproc_per_node} --rdzv-backend c10d --rdzv-endpoint {endpoint} "
                    f"--rdzv-id my-job -m")
        commands.append(f"{head} {rest}")
    return commands


#: torch's opt-out of the rank-0 agent's TCP store on its own address (``--local-addr``).
NO_AGENT_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def group_ranks(local_addrs: Sequence[str], timeout: float = 30.0) -> dict[str, int]:
    """Run torch's c10d rendezvous for one agent per address; return each one's GROUP_RANK.

    Each agent is a rendezvous handler in a thread of this process, made by torch's own
    registry with ``local_addr`` as torchrun's ``--local-addr`` gives it, so the numbering is
    torch's (no worker starts). The store is served from 127.0.0.1 and an address is only the
    agent's name in the rendezvous: no agent opens a store of its own on it
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` during the call; torchrun's rank-0 agent would),
    so 127.0.0.2 works on macOS too, which configures only 127.0.0.1. Every agent runs on this
    machine, so every address must be a loopback address (any 127.x.y.z); any other is
    refused at once.

    Args:
        local_addrs: one address per agent, all different, in the order the agents start.
        timeout: seconds to wait for every agent to join.

    Returns:
        ``{address: GROUP_RANK}``.

    Raises:
        ValueError: an address repeats, or is not a 127.x.y.z loopback address.

    Lesson: 07b.
    """
    import threading
    import uuid

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ..env import free_port

    addrs = [str(a) for a in local_addrs]
    if len(set(addrs)) != len(addrs) or not addrs:
        raise ValueError(f"local_addrs={addrs}: give one address per agent, all different.")
    outside = [a for a in addrs if not _is_loopback_v4(a)]
    if outside:
        raise ValueError(f"{outside}: every agent runs on this machine, so give loopback"
                         " addresses 127.x.y.z (a host name such as gpu2 sorts as a string too:"
                         " 127.0.0.2 stands for it).")
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"ddplab-{uuid.uuid4().hex[:8]}"
    handlers = [get_rendezvous_handler(RendezvousParameters(
        "c10d", endpoint, run_id, len(addrs), len(addrs), local_addr=addr,
        is_host=index == 0, join_timeout=timeout)) for index, addr in enumerate(addrs)]
    found: dict[str, Any] = {}

    def join(addr: str, handler: Any) -> None:
        try:
            found[addr] = handler.next_rendezvous().rank
        except Exception as exc:  # noqa: BLE001  (raised below, in the caller's thread)
            found[addr] = exc

    threads = [threading.Thread(target=join, args=pair, daemon=True)
               for pair in zip(addrs, handlers)]
    shared = os.environ.get(NO_AGENT_STORE)
    os.environ[NO_AGENT_STORE] = "1"   # read by each handler as it joins (dynamic_rendezvous.py)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 5)
    finally:
        for handler in reversed(handlers):
            handler.shutdown()
        if shared is None:
            os.environ.pop(NO_AGENT_STORE, None)
        else:
            os.environ[NO_AGENT_STORE] = shared
    errors = [v for v in found.values() if isinstance(v, Exception)]
    if errors or len(found) < len(addrs):
        raise RuntimeError(f"the rendezvous of {addrs} did not complete: {errors or found}")
    return {addr: int(found[addr]) for addr in addrs}


def _is_loopback_v4(addr: str) -> bool:
    """True for a dotted IPv4 address in 127.0.0.0/8 (this machine's loopback)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return ip.version == 4 and ip in ipaddress.ip_network("127.0.0.0/8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddplab.lab.slurm [--nodes N ...] [-- TARGET_ARGS...]``: print the batch
    script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, target_args = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="python -m ddplab.lab.slurm", description=render.__doc__
                                .split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--cpus-per-task", type=int, default=16)
    p.add_argument("--time", default="00:30:00")
    p.add_argument("--job-name", default="ddplab")
    p.add_argument("--partition", default=None)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--target", default="ddplab.workers.train")
    ns = p.parse_args(argv)
    print(render(ns.nodes, ns.gpus_per_node, target=ns.target, cpus_per_task=ns.cpus_per_task,
                 target_args=target_args or None, time=ns.time, job_name=ns.job_name,
                 partition=ns.partition, port=ns.port), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
