"""Every rank prints many long lines at once, on stdout and stderr, as fast as it can.

Run it: ``torchrun --nproc-per-node 4 tests/scripts/long_lines.py`` (a torchrun-style script),
or ``python tests/scripts/long_lines.py spawn 4`` (it calls ``mp.spawn`` itself; its ranks set
up by ``ddplab.dist.setup``, which is how the launcher tells their lines apart). Each line
says whose it is and ends with a checksum of its length, so a cut or merged line shows.
"""
import os
import sys

LINES, WIDTH = 40, 9000  # longer than a pipe's atomic write (4096 bytes)


def line(rank: int, index: int, stream: str) -> str:
    body = f"{stream} rank {rank} line {index} " + chr(97 + (rank + index) % 26) * WIDTH
    return f"{body} len {len(body)}"


def speak(rank: int) -> None:
    for index in range(LINES):
        print(line(rank, index, "out"), flush=True)
        print(line(rank, index, "err"), file=sys.stderr, flush=True)


def spawned(rank: int, world_size: int) -> None:
    from ddplab.dist import setup

    setup(rank=rank, world_size=world_size)
    speak(rank)


if __name__ == "__main__":
    if sys.argv[1:2] == ["spawn"]:
        import torch.multiprocessing as mp

        nprocs = int(sys.argv[2])
        mp.spawn(spawned, args=(nprocs,), nprocs=nprocs)
    else:
        speak(int(os.environ["RANK"]))
