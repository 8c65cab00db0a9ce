"""Exercise 03's judge on two wrong solutions it used to misjudge: one that never calls
``set_epoch`` (accepted before), one that never wraps the model and copies rank 0's weights by
hand (told it "wrapped the model in DDP", which it never did)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ddplab

pytestmark = pytest.mark.slow

SOLUTION = Path(__file__).resolve().parent / "solutions" / "ddp_wrap.py"
WRAP = "    model = DDP(model, device_ids=[device.index] if device.type == \"cuda\" else None)\n"
VARIANTS = {
    "no set_epoch": ("        sampler.set_epoch(epoch)\n", ""),
    "broadcast by hand": (WRAP, "    for p in model.parameters():\n"
                                "        dist.broadcast(p.data, src=0)\n"),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("ddp_wrap")

    def judged(name: str):
        old, new = VARIANTS[name]
        text = SOLUTION.read_text()
        assert old in text, f"{old!r} is not in {SOLUTION.name} any more"
        path = folder / name.replace(" ", "_") / "ddp_wrap.py"
        path.parent.mkdir()
        path.write_text(text.replace(old, new))
        result = ddplab.launch(str(path), 2, quiet=True, live=False, timeout=120)
        return ddplab.check("03", result)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(VARIANTS, pool.map(judged, VARIANTS)))


def test_a_loop_without_set_epoch_is_rejected_and_told_why(verdicts):
    verdict = verdicts["no set_epoch"]
    assert not verdict and "set_epoch" in verdict.message and "[0, 0]" in verdict.message


def test_weights_copied_by_hand_are_named_as_such(verdicts):
    verdict = verdicts["broadcast by hand"]
    assert not verdict
    assert "no DistributedDataParallel wrapper" in verdict.message and "by hand" in verdict.message
    assert "you wrapped the model" not in verdict.message
