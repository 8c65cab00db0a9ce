"""An mp.spawn script that runs a short program of its own before spawning its ranks.

Run it: ``python tests/scripts/spawn_runs_a_program.py``. The program (``sleep 0.6``) is a child
of the script, as ``ldconfig -p`` is during ``import torch``, but not a rank: each of the two
ranks prints its rank; the job has two ranks, not three.
"""
import subprocess

import torch.multiprocessing as mp


def worker(rank: int) -> None:
    print(f"rank {rank} runs", flush=True)


if __name__ == "__main__":
    subprocess.run(["sleep", "0.6"], check=True)
    mp.spawn(worker, nprocs=2)
