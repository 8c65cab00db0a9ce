"""Launch cost: ddplab's cold and warm launches against plain torchrun on a trivial gloo job.

Targets: cold ``python -m ddplab launch`` <= 0.75x ``python -m torch.distributed.run
--standalone``; a warm ``ddplab.launch`` (second and later calls in one process, as in a
notebook kernel) <= 0.10x the same torchrun; the same warm launch where workers cannot be
forked (macOS; here ``DDPLAB_LAUNCH_PATH=subprocess``: torchrun and its ranks in warm processes,
see ``ddplab/launcher/spares.py``) <= 2 s. Beside it: that path launched back to back (its
warm processes still starting) and with ``DDPLAB_SPARES=off`` (a cold torchrun subprocess per
launch, as before). Run: ``python benchmarks/bench_launch.py [-n 5]``.
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
NO_FORK = "ddplab.launch, no fork (warm)"
NO_FORK_TARGET = 2.0  # seconds


def _settle() -> None:
    """Wait, untimed, until the warm processes of the no-fork path have all started, so
    that their imports never run during another setup's measurement."""
    from ddplab.launcher.spares import Pool

    pool = Pool.current()
    if pool is not None:
        pool.wait_ready()


def _no_fork(**env: str) -> Callable[[], float]:
    """A launch through the path taken where workers cannot be forked (its notice printed once).

    ``back_to_back``: one untimed launch first, then the timed one at once, while the
    processes that replace the used ones are still importing torch.
    """
    import ddplab

    back_to_back = env.pop("back_to_back", "")

    def run() -> float:
        saved = {name: os.environ.get(name) for name in ("DDPLAB_LAUNCH_PATH", *env)}
        os.environ.update(DDPLAB_LAUNCH_PATH="subprocess", **env)
        try:
            _settle()
            if back_to_back:
                ddplab.launch(JOB, 2, quiet=True).check()
            return timed(lambda: ddplab.launch(JOB, 2, quiet=True).check())
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _settle()

    run()  # the first launch starts the warm processes
    return run


def _peers() -> dict[str, Callable[[], float]]:
    """The warm launch's peers, each warmed up once (their first call imports and starts)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
    import peers

    found: dict[str, Callable[[], float]] = {
        "bare fork start_processes (warm)": lambda: timed(peers.bare_fork)}
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
    """One sentence: the path without fork, warm, back to back, and cold."""
    medians = result["medians"]
    return (f"Without fork (macOS; here DDPLAB_LAUNCH_PATH=subprocess) a warm launch took "
            f"{medians[NO_FORK]:.2f} s (target {NO_FORK_TARGET:.0f} s): torchrun and both ranks "
            f"ran in processes that had imported torch before the launch. Launched back to "
            f"back, while the processes replacing the used ones still import torch, it took "
            f"{medians['ddplab.launch, no fork (back to back)']:.2f} s; with "
            f"DDPLAB_SPARES=off (a cold torchrun subprocess, every process importing torch) "
            f"{medians['ddplab.launch, no fork, DDPLAB_SPARES=off']:.2f} s.")


def _peer_finding(result: dict) -> str:
    """One sentence: the warm launch beside its peers (target: no slower than notebook_launcher)."""
    ratio = result["peer_ratio"].get("ddplab.launch (warm) / notebook_launcher (warm)")
    if ratio is None:
        return "Peers: accelerate is not installed, notebook_launcher was not measured."
    verdict = "met" if ratio <= 1.0 else "missed"
    return (f"Peers, same job, same run: the warm launch takes {ratio:.2f}x the time of "
            "accelerate's notebook_launcher (target: no slower, 1.00x; " + verdict + "), which "
            "forks the caller and runs a function instead of a file; a bare fork of two "
            "processes (no agent, no rendezvous, no clean-up) is the floor.")


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
        return lambda: (_settle(), timed(lambda: run_cmd(cmd, env=env)))[1]

    os.environ.update(env_one)  # the peers fork this process: same threads as the others
    peers = _peers()

    candidates = {
        "torchrun (cold)": cold(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB]),
        "ddplab launch CLI (cold)": cold(
            [PY, "-m", "ddplab", "launch", "--nproc-per-node", "2", "--quiet", JOB]),
        "ddplab.launch (warm)": warm,
        NO_FORK: _no_fork(),
        "ddplab.launch, no fork (back to back)": _no_fork(back_to_back="1"),
        "ddplab.launch, no fork, DDPLAB_SPARES=off": _no_fork(DDPLAB_SPARES="off"),
        **peers,
    }
    result = summary(interleaved(candidates, ns.repeats), baseline="torchrun (cold)")
    result["targets"] = {"ddplab launch CLI (cold)": 0.75, "ddplab.launch (warm)": 0.10,
                         NO_FORK: {"limit": NO_FORK_TARGET, "on": "value"}}
    if NOTEBOOK_LAUNCHER in peers:
        ratio = (result["medians"]["ddplab.launch (warm)"]
                 / result["medians"][NOTEBOOK_LAUNCHER])
        result["peer_ratio"] = {"ddplab.launch (warm) / notebook_launcher (warm)": ratio}
    else:
        result["peer_ratio"] = {"missing": "accelerate is not installed (make bench installs it)"}
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
    if result["medians"][NO_FORK] > NO_FORK_TARGET:
        result["why"][NO_FORK] = _no_fork_finding(result)
    path = save("launch", result)
    for name, ratio in result["peer_ratio"].items():
        print(f"{name}: {ratio if isinstance(ratio, str) else f'{ratio:.2f}'}")
    for name, ratio in result["ratios"].items():
        print(f"{name:28s} median {result['medians'][name]:6.2f} s  ratio {ratio:5.2f}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
