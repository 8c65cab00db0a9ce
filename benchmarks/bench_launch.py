"""Launch cost: ddplab's cold and warm launches against plain torchrun on a trivial gloo job.

Targets: cold ``python -m ddplab launch`` <= 0.75x ``python -m torch.distributed.run
--standalone``; a warm ``ddplab.launch`` (second and later calls in one process, as in a
notebook kernel) <= 0.10x the same torchrun. Run: ``python benchmarks/bench_launch.py [-n 5]``.
"""

from __future__ import annotations

import argparse

from common import PY, ROOT, interleaved, run_cmd, save, summary, timed

JOB = str(ROOT / "benchmarks" / "scripts" / "trivial_gloo.py")


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--repeats", type=int, default=5)
    ns = parser.parse_args()
    env_one = {"OMP_NUM_THREADS": "1"}
    import os

    env = {**os.environ, **env_one}
    import ddplab

    ddplab.launch(JOB, 2, quiet=True).check()  # start the kernel's helper: later calls are warm

    def warm() -> float:
        return timed(lambda: ddplab.launch(JOB, 2, quiet=True).check())

    candidates = {
        "torchrun (cold)": lambda: timed(lambda: run_cmd(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB],
            env=env)),
        "ddplab launch CLI (cold)": lambda: timed(lambda: run_cmd(
            [PY, "-m", "ddplab", "launch", "--nproc-per-node", "2", "--quiet", JOB], env=env)),
        "ddplab.launch (warm)": warm,
    }
    result = summary(interleaved(candidates, ns.repeats), baseline="torchrun (cold)")
    result["targets"] = {"ddplab launch CLI (cold)": 0.75, "ddplab.launch (warm)": 0.10}
    path = save("launch", result)
    for name, ratio in result["ratios"].items():
        print(f"{name:28s} median {result['medians'][name]:6.2f} s  ratio {ratio:5.2f}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
