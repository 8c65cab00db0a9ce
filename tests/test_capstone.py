"""The capstone (13): the reference (ddplab.workers.capstone) and a plain-torch solution of the
skeleton pass the judge over real unbroken, killed and resumed launches; the empty skeleton
stops at its first function and the judge names it; classic mistakes, launched for real, are
rejected with a hint that names them (no set_epoch, a checkpoint written by every rank, no
barrier after the save, a resume that ignores the checkpoint)."""

from __future__ import annotations

import copy
import difflib
import shutil
from pathlib import Path

import pytest

import ddplab
from ddplab.lab import judges
from ddplab.lab.judges import capstone as judge13
from ddplab import RunResult

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "ddplab.workers.capstone"
SOLUTION = ROOT / "tests" / "solutions" / "capstone.py"
SKELETON = ROOT / "exercises" / "capstone.py"
KILL = ["--kill-rank", "1", "--kill-epoch", "3"]
BASE_LR = 0.02  # the capstone's default --lr


def launch(target, folder: Path, *args: str, ok: bool = True) -> RunResult:
    result = ddplab.launch(str(target), 2, args=["--checkpoint-dir", str(folder), *args],
                           quiet=True, live=False, timeout=300)
    assert result.ok is ok, result.error
    return result


def three_runs(target, tmp: Path) -> dict[str, RunResult]:
    """The capstone's three launches: unbroken, killed in epoch 3, resumed from its folder."""
    unbroken = launch(target, tmp / "unbroken")
    killed = launch(target, tmp / "killed", *KILL, ok=False)
    shutil.copytree(tmp / "killed", tmp / "killed-copy")  # for a second resume, below
    resumed = launch(target, tmp / "killed")
    return {"unbroken": unbroken, "killed": killed, "resumed": resumed}


def variant(tmp: Path, name: str, body: str) -> Path:
    """The reference with one function replaced by a classic mistake."""
    path = tmp / f"{name}.py"
    path.write_text("from ddplab.workers.capstone import *  # noqa: F401,F403\n\n"
                    "import sys\n\nimport torch.distributed as dist\n\n"
                    "from ddplab import capstone, checkpoint\n"
                    "from ddplab.workers import capstone as reference\n\n"
                    f"{body}\n\n"
                    "if __name__ == '__main__':\n"
                    "    capstone.run(sys.modules[__name__])\n")
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("capstone")


@pytest.fixture(scope="module")
def reference(tmp) -> dict[str, RunResult]:
    return three_runs(REFERENCE, tmp / "reference")


def hint(answer) -> str:
    verdict = ddplab.check("13", answer)
    assert not verdict
    return verdict.message


# ----------------------------------------------------------------------------- right answers


def test_reference_passes_and_resumes_exactly(reference):
    assert ddplab.check("13", reference)
    unbroken, killed, resumed = (reference[k] for k in judge13.RUNS)
    assert killed.root_cause.rank == 1 and killed.root_cause.signal == "SIGKILL"
    assert resumed.summary["start_epoch"] == 2 and len(resumed.summary["history"]) == 2
    assert resumed.summary["param_checksum"] == unbroken.summary["param_checksum"]
    assert resumed.summary["final_accuracy"] == unbroken.summary["final_accuracy"] > 0.9
    assert unbroken.summary["amp_dtype"] == "bfloat16" and unbroken.summary["base_lr"] == BASE_LR


def test_a_plain_torch_solution_of_the_skeleton_passes(tmp):
    assert judge13.unanswered(SOLUTION) == []
    assert ddplab.check("13", three_runs(SOLUTION, tmp / "solution"))


def test_one_run_alone_is_judged_and_asks_for_the_other_two(reference):
    message = hint(reference["unbroken"])
    assert "what the run did is right" in message and "killed, resumed" in message


def test_registered_with_its_skeleton_and_the_solution_only_fills_the_gaps():
    assert judges.load_all()["13"].skeleton == "capstone.py"
    assert judges.skeleton_path("13") == SKELETON
    skeleton, solution = SKELETON.read_text().splitlines(), SOLUTION.read_text().splitlines()
    matcher = difflib.SequenceMatcher(a=skeleton, b=solution, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag != "equal" and i1 > 0:  # the docstring's first line names the solution
            assert skeleton[i1:i2] == ["    # TODO(exercise)", "    raise NotImplementedError"]


# ----------------------------------------------------------------------------- the skeleton


def test_the_empty_skeleton_stops_at_its_first_function_and_the_judge_names_it(tmp):
    assert judge13.unanswered(SKELETON) == list(judge13.FUNCTIONS)
    assert judge13.unanswered(ROOT / "ddplab" / "workers" / "capstone.py") == []
    result = launch(SKELETON, tmp / "skeleton")
    assert "`make_loader`" in hint(result) and "still empty" in hint(result)
    assert "`make_loader`" in hint({"unbroken": result})


# ----------------------------------------------------------------------------- wrong answers


def test_forgetting_set_epoch_is_rejected(tmp):
    path = variant(tmp, "no_set_epoch", (
        "class Forgetful:\n"
        "    def __init__(self, loader):\n"
        "        self.loader = loader\n"
        "    def set_epoch(self, epoch):\n"
        "        pass  # the mistake: the sampler stays at epoch 0\n"
        "    def __iter__(self):\n"
        "        return iter(self.loader)\n"
        "    def __len__(self):\n"
        "        return len(self.loader)\n\n"
        "def make_loader(*args):\n"
        "    return Forgetful(reference.make_loader(*args))"))
    message = hint({"unbroken": launch(path, tmp / "no_set_epoch")})
    assert "same order in every epoch" in message and "set_epoch" in message


SAVE = ("def save_checkpoint(path, model, optimizer, scaler, epoch, rank):\n"
        "    state = {'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),\n"
        "             'scaler': scaler.state_dict(), 'epoch': epoch}\n")


def test_a_checkpoint_written_by_every_rank_is_rejected(tmp):
    path = variant(tmp, "every_rank", SAVE + (
        "    checkpoint.atomic_save(state, path)  # the mistake: on every rank\n"
        "    dist.barrier()"))
    message = hint({"unbroken": launch(path, tmp / "every_rank")})
    assert "rank 1 wrote the checkpoint too" in message and "rank == 0" in message


def test_a_save_without_barrier_is_rejected(tmp):
    path = variant(tmp, "no_barrier", SAVE + (
        "    if rank == 0:\n"
        "        checkpoint.atomic_save(state, path)  # the mistake: nobody waits"))
    message = hint({"unbroken": launch(path, tmp / "no_barrier")})
    assert "rank 1 returned from `save_checkpoint` before the file" in message
    assert "barrier" in message


def test_a_resume_that_ignores_the_checkpoint_is_rejected(tmp, reference):
    path = variant(tmp, "no_resume", (
        "def resume(path, model, optimizer, scaler, device):\n"
        "    return 0  # the mistake: start again from scratch"))
    resumed = launch(path, tmp / "reference" / "killed-copy")
    assert resumed.summary["param_checksum"] == reference["unbroken"].summary["param_checksum"]
    message = hint({**reference, "resumed": resumed})  # the same weights, trained twice
    assert "`resume` returned 0 although the checkpoint holds 2 epochs" in message


def _edited(result: RunResult, name: str, change) -> RunResult:
    """A copy of ``result`` whose ``name`` metric values are changed by ``change(rank, value)``."""
    fake = copy.deepcopy(result)
    for rank, events in fake.events.items():
        for event in events:
            if event.get("kind") == "metric" and event.get("name") == name:
                change(rank, event["value"])
    return fake


@pytest.mark.parametrize("change, words", [
    (lambda r, v: v["read"].update(meta=["cpu"]) if "read" in v else None, "map_location"),
    (lambda r, v: v["save"].update(renamed=False) if r == 0 else None, "atomically"),
    (lambda r, v: v["eval"].update(wrapper_forwards=1) if r == 0 else None, "model.module"),
    (lambda r, v: v.update(lrs=[[s, BASE_LR] for s, _ in v["lrs"]]), "never scaled"),
    (lambda r, v: v.update(under_autocast=0), "without autocast"),
])
def test_other_mistakes_get_their_own_hint(reference, change, words):
    assert words in hint(_edited(reference["unbroken"], "epoch_facts", change))


def test_different_weights_after_the_resume_are_rejected(reference):
    def drift(rank, value):
        value["checksum"] += 1e-3

    message = hint({**reference, "resumed": _edited(reference["resumed"], "end", drift)})
    assert "other weights than the unbroken one" in message


def test_unanswered_lists_the_empty_functions_in_the_order_the_run_calls_them(tmp_path):
    text = SKELETON.read_text().replace(
        "    # TODO(exercise)\n    raise NotImplementedError\n", "    return None\n", 2)
    partial = tmp_path / "capstone.py"
    partial.write_text(text.replace("def evaluate(", "def evaluate_later("))
    assert judge13.unanswered(partial) == list(judge13.FUNCTIONS[2:])   # evaluate: not defined


def test_a_world_of_one_process_runs_the_same_functions(tmp):
    alone = ddplab.launch(REFERENCE, 1, args=["--checkpoint-dir", str(tmp / "alone")],
                          quiet=True, live=False, timeout=300)
    assert "what the run did is right" in hint(alone.check())
    assert judges.metric(alone, "setup")[0]["wrapper"] == "DistributedDataParallel"
