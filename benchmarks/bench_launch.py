"""Launch cost: ddplab's cold and warm launches against plain torchrun on a trivial gloo job.

Targets: cold ``python -m ddplab launch`` <= 0.50x ``python -m torch.distributed.run
--standalone``; a warm ``ddplab.launch`` (second and later calls in one process, as in a
notebook kernel) <= 0.10x the same torchrun, and beside its peers in the same run <= 1.00x
accelerate's ``notebook_launcher`` and <= 1.50x a bare fork of the same two processes. Beside
them, no target: a launch where workers cannot be forked (macOS; here
``DDPLAB_LAUNCH_PATH=subprocess``: a cold torchrun subprocess).
Run: ``python benchmarks/bench_launch.py [-n 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

from common import PY, ROOT, interleaved, run_cmd, save, summary, timed

JOB = str(ROOT / "benchmarks" / "scripts" / "trivial_gloo.py")
TIMED_JOB = str(ROOT / "benchmarks" / "scripts" / "trivial_gloo_timed.py")


def warm_phases(repeats: int) -> dict[str, float]:
    """Where a warm launch's time goes (medians, seconds): before, in and after the script.

    ``start``: from the ``ddplab.launch`` call until the slower rank's script begins (helper
    fork, elastic agent, rendezvous, worker fork); ``script``: the script itself (torch is
    already imported, so mostly init_process_group); ``finish``: from the later script end
    until ``launch`` returns (workers exit, the agent notices and reports, clean-up).
    """
    import ddplab

    phases: dict[str, list[float]] = {"start": [], "script": [], "finish": []}
    for _ in range(repeats):
        called = time.time()
        result = ddplab.launch(TIMED_JOB, 2, quiet=True).check()
        returned = time.time()
        spans = [[float(x) for x in result.log(rank).split()[1:3]] for rank in (0, 1)]
        began, ended = max(s[0] for s in spans), max(s[1] for s in spans)
        phases["start"].append(began - called)
        phases["script"].append(ended - began)
        phases["finish"].append(returned - ended)
    return {name: statistics.median(values) for name, values in phases.items()}


NOTEBOOK_LAUNCHER = "accelerate notebook_launcher (warm)"
BARE_FORK = "bare fork start_processes (warm)"
ELASTIC = "torch elastic_launch in the caller (warm)"
#: The warm launch against each peer, measured in the same run: at most this ratio.
PEER_TARGETS = {NOTEBOOK_LAUNCHER: 1.00, BARE_FORK: 1.50}
NO_FORK = "ddplab.launch, no fork (cold torchrun subprocess)"


def _no_fork() -> float:
    """One launch through the path taken where workers cannot be forked."""
    import ddplab

    saved = os.environ.get("DDPLAB_LAUNCH_PATH")
    os.environ["DDPLAB_LAUNCH_PATH"] = "subprocess"
    try:
        return timed(lambda: ddplab.launch(JOB, 2, quiet=True).check())
    finally:
        if saved is None:
            os.environ.pop("DDPLAB_LAUNCH_PATH", None)
        else:
            os.environ["DDPLAB_LAUNCH_PATH"] = saved


def _peers() -> dict[str, Callable[[], float]]:
    """The warm launch's peers, each warmed up once (their first call imports and starts)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
    import peers

    found: dict[str, Callable[[], float]] = {
        BARE_FORK: lambda: timed(peers.bare_fork), ELASTIC: lambda: timed(peers.elastic_agent)}
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("accelerate is not installed: notebook_launcher not measured (make bench "
              "installs it)")
    else:
        found[NOTEBOOK_LAUNCHER] = lambda: timed(peers.notebook_launcher)
    for fn in found.values():
        fn()
    return found


def _no_fork_finding(result: dict) -> str:
    """One sentence: the path without fork, beside torchrun."""
    medians = result["medians"]
    return (f"Without fork (macOS; here DDPLAB_LAUNCH_PATH=subprocess) a launch is a cold "
            f"torchrun subprocess: {medians[NO_FORK]:.2f} s, against "
            f"{medians['torchrun (cold)']:.2f} s for torchrun itself.")


def _peer_finding(result: dict) -> str:
    """One sentence: the warm launch beside its peers, each ratio against its target."""
    parts = []
    for peer, limit in PEER_TARGETS.items():
        ratio = result["peer_ratio"].get(peer)
        if ratio is None:
            parts.append(f"{peer}: not measured (accelerate is not installed)")
            continue
        verdict = "met" if ratio <= limit else "missed"
        parts.append(f"{ratio:.2f}x the time of {peer} (target <= {limit:.2f}x; {verdict})")
    medians = result["medians"]
    agent, bare, warm = (medians[name] for name in (ELASTIC, BARE_FORK, "ddplab.launch (warm)"))
    return ("Peers, same job, same run: the warm launch takes " + "; ".join(parts) + ". "
            "notebook_launcher forks the caller and runs a function instead of a file; a bare "
            "fork of two processes (no agent, no rendezvous, no clean-up) is the floor. torch's "
            f"elastic_launch run in the caller, looking at its workers every 10 ms as ddplab's "
            f"agent does, takes {agent / bare:.2f}x the bare fork (notebook_launcher's agent "
            f"looks every 100 ms); the warm launch's other {1000 * (warm - agent):.0f} ms are "
            "ddplab's own: the agent forked from the helper (which then serves the workers' "
            "store itself, once they are forked), and the wait until it has exited.")


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--repeats", type=int, default=5)
    ns = parser.parse_args()
    env_one = {"OMP_NUM_THREADS": "1"}
    env = {**os.environ, **env_one}
    import ddplab

    ddplab.launch(JOB, 2, quiet=True).check()  # start the kernel's helper: later calls are warm

    def warm() -> float:
        return timed(lambda: ddplab.launch(JOB, 2, quiet=True).check())

    def cold(cmd: list[str]) -> Callable[[], float]:
        return lambda: timed(lambda: run_cmd(cmd, env=env))

    os.environ.update(env_one)  # the peers fork this process: same threads as the others
    peers = _peers()

    candidates = {
        "torchrun (cold)": cold(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB]),
        "ddplab launch CLI (cold)": cold(
            [PY, "-m", "ddplab", "launch", "--nproc-per-node", "2", "--quiet", JOB]),
        "ddplab.launch (warm)": warm,
        NO_FORK: _no_fork,
        **peers,
    }
    result = summary(interleaved(candidates, ns.repeats), baseline="torchrun (cold)")
    result["targets"] = {"ddplab launch CLI (cold)": 0.50, "ddplab.launch (warm)": 0.10}
    warm_median = result["medians"]["ddplab.launch (warm)"]
    result["peer_ratio"] = {peer: warm_median / result["medians"][peer]
                            for peer in PEER_TARGETS if peer in peers}
    phases = warm_phases(ns.repeats)
    result["warm_phases"] = phases
    finding = ("Where a warm launch's time goes (medians of {n} more launches of the same job, "
               "printing its start and end): {start:.0f} ms until the scripts start (fork of "
               "the agent, rendezvous, fork of the workers), {script:.0f} ms in the scripts "
               "(init_process_group, all_reduce, destroy), {finish:.0f} ms from their end "
               "until the result is back (workers exit, the agent reports).").format(
        n=ns.repeats, **{k: 1000 * v for k, v in phases.items()})
    result["findings"] = [finding, _no_fork_finding(result), _peer_finding(result)]
    cold = result["medians"]["torchrun (cold)"]
    result["why"] = {
        name: (f"{result['medians'][name]:.2f} s against {cold:.2f} s for torchrun. " + finding)
        for name, limit in result["targets"].items()
        if isinstance(limit, float) and result["ratios"][name] > limit}
    path = save("launch", result)
    for name, ratio in result["peer_ratio"].items():
        print(f"ddplab.launch (warm) / {name}: {ratio:.2f} (target {PEER_TARGETS[name]:.2f})")
    for name, ratio in result["ratios"].items():
        print(f"{name:28s} median {result['medians'][name]:6.2f} s  ratio {ratio:5.2f}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
