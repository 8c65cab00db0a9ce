"""The torch releases this course was tested on, and how to install the tested set.

`make setup` installs exact versions from ``requirements/lock.txt``; ``TESTED`` says what ran on
each release (README, "Torch versions", has the same table with dates). ``python -m ddplab
doctor`` compares the installed torch with it, so a learner whose pip picked a newer torch hears
it from the doctor before a lesson breaks.

Example::

    >>> from ddplab import versions
    >>> versions.torch_status("2.14.1+cu130")
    'the locked set: make test (every test and notebook) runs on it in CI'
    >>> versions.drift("2.14.1") is None
    True

Lesson: the hardware cell of every notebook (the doctor report).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The locked pair (requirements/pins.txt; tests/test_packaging.py keeps the three in step).
LOCKED_TORCH = "2.14.1"
LOCKED_TORCHVISION = "0.29.1"

# release -> what ran on it (the newest release and the floor run `make test-compat`).
TESTED = {
    LOCKED_TORCH: "the locked set: make test (every test and notebook) runs on it in CI",
    "2.15.0": "the newest release: make test-compat TORCH=2.15.0 (launcher, training and "
              "collectives tests, notebooks 03, 07, 08, 10-12)",
    "2.6.0": "the oldest supported release: make test-compat (the same set as 2.15.0)",
}

LOCK_FILE = Path(__file__).resolve().parent.parent / "requirements" / "lock.txt"


def release(version: str) -> str:
    """``"2.14.1+cu130"`` -> ``"2.14.1"``: the public release, without the local build tag."""
    return version.split("+", 1)[0]


def torch_status(version: str) -> str:
    """What ran on this torch version, or ``""`` when the course was not tested on it."""
    return TESTED.get(release(version), "")


def drift(version: str) -> tuple[str, str] | None:
    """``(problem, fix)`` when ``version`` is not a tested release, else None."""
    if torch_status(version):
        return None
    known = ", ".join(sorted(TESTED, key=lambda v: tuple(int(p) for p in v.split("."))))
    return (f"torch {release(version)} is not a release this course was tested on ({known})",
            f"install the tested set: {install_command()}")


def install_command() -> str:
    """The one command that installs the tested set into the running Python.

    In a clone it is the lock file (every package at its tested version); from an installed
    ddplab, which ships no lock, the tested torch and torchvision.
    """
    python = sys.executable or "python"
    if LOCK_FILE.is_file():
        return f"{python} -m pip install -r {LOCK_FILE}"
    return f"{python} -m pip install torch=={LOCKED_TORCH} torchvision=={LOCKED_TORCHVISION}"
