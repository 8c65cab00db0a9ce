"""Rank 1 dies by SIGABRT in a frame of this file, as a rank does when gloo's C++ code aborts in
a collective (a shape mismatch): the launch shows the line it died on, on every path.

Run it: ``torchrun --nproc-per-node 2 tests/scripts/aborts.py``.
"""
import os


def crash() -> None:
    os.abort()  # rank 1 dies here


if os.environ["RANK"] == "1":
    crash()
print(f"rank {os.environ['RANK']} done", flush=True)
