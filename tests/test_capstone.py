"""The capstone (13): the reference job and a right job in another style pass the judge over
real launches (DDP, FSDP2, killed, resumed bit for bit, resumed on 4 ranks); the skeleton is
told to write the job; each classic mistake, made by a small edit of the reference's text and
launched for real, is rejected with a hint that names it; a deadlock is called a hang."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ddplab
from ddplab import RunResult
from ddplab.lab import judges
from ddplab.lab.judges import capstone as judge13

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "ddplab" / "workers" / "capstone.py"
SOLUTION = ROOT / "tests" / "solutions" / "capstone.py"
SKELETON = ROOT / "exercises" / "capstone.py"
KILL = ["--kill-rank", "1", "--kill-at-step", "24"]  # mid-epoch, just after the save of step 24


def launch(target, folder: Path, *args: str, nprocs: int = 2, ok: bool = True,
           timeout: float = 300) -> RunResult:
    result = ddplab.launch(str(target), nprocs, args=["--checkpoint-dir", str(folder), *args],
                           quiet=True, live=False, timeout=timeout)
    assert result.ok is ok, result.error
    return result


def five_runs(target, tmp: Path) -> dict[str, RunResult]:
    """The notebook's five launches of one job."""
    runs = {"ddp": launch(target, tmp / "ddp"),
            "fsdp": launch(target, tmp / "fsdp", "--strategy", "fsdp"),
            "killed": launch(target, tmp / "job", *KILL, ok=False)}
    shutil.copytree(tmp / "job", tmp / "job-4")
    runs["resumed"] = launch(target, tmp / "job")
    runs["resharded"] = launch(target, tmp / "job-4", "--strategy", "fsdp", nprocs=4)
    return runs


def variant(tmp: Path, name: str, *edits: tuple[str, str]) -> Path:
    """The reference with a classic mistake: each edit replaces one text by another."""
    text = REFERENCE.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp / f"{name}.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("capstone")


@pytest.fixture(scope="module")
def reference(tmp) -> dict[str, RunResult]:
    return five_runs(REFERENCE, tmp / "reference")


def hint(answer, reference) -> str:
    answer = {"ddp": answer} if judges.is_run_result(answer) else answer
    verdict = ddplab.check("13", {**answer, "reference": reference["ddp"]})
    assert not verdict
    return verdict.message


# ----------------------------------------------------------------------------- right answers


def test_the_reference_passes_and_resumes_exactly(reference):
    assert ddplab.check("13", {**reference, "reference": reference["ddp"]})
    killed = reference["killed"]
    assert killed.root_cause.rank == 1 and killed.root_cause.signal == "SIGKILL"
    steps = judge13._steps(reference["resumed"])
    assert min(steps[0]) == 24 and max(steps[0]) == max(judge13._steps(reference["ddp"])[0])
    assert judge13._squares(reference["resumed"]) == judge13._squares(reference["ddp"])
    assert set(judge13._steps(reference["resharded"])) == {0, 1, 2, 3}


def test_a_right_job_in_another_style_passes(tmp, reference):
    assert judge13.unanswered(SKELETON) and not judge13.unanswered(SOLUTION)
    assert ddplab.check("13", {**five_runs(SOLUTION, tmp / "solution"),
                               "reference": reference["ddp"]})


def test_one_run_alone_is_judged_and_asks_for_the_others(reference):
    message = hint(reference["ddp"], reference)
    assert "what the DDP run did is right" in message and "fsdp, killed" in message


def test_registered_with_its_skeleton():
    assert judges.load_all()["13"].skeleton == "capstone.py"
    assert judges.skeleton_path("13") == SKELETON


def test_the_skeleton_is_told_to_write_the_job(tmp, reference):
    message = hint(launch(SKELETON, tmp / "skeleton"), reference)
    assert "reported no steps" in message and "log_step" in message


# ----------------------------------------------------------------------------- wrong answers


@pytest.mark.parametrize("name, edits, words", [
    ("seed_plus_rank", [("seed=args.seed)", "seed=args.seed + rank)")], ["same seed",
                                                                        "seed + rank"]),
    ("loss_over_world", [("loss = F.cross_entropy(model(inputs), labels)",
                          "loss = F.cross_entropy(model(inputs), labels) / world")],
     ["divide the loss by the world size"]),
    ("no_zero_grad", [("            optimizer.zero_grad()\n", "")], ["zero_grad"]),
    ("no_set_epoch", [("        sampler.set_epoch(epoch)", "        pass")],
     ["same order in every epoch", "set_epoch"]),
    ("torch_save_everywhere", [("    dcp.save({", "    torch.save({"), (
        'checkpoint_id=os.path.join(folder, f"step-{step}"))', 'os.path.join(folder, "last.pt"))')],
     ["as big as rank 0's", "only rank 0 writes"]),
    ("eval_through_wrapper", [("    net = build_model(args)\n    net.load_state_dict(full)\n"
                               "    net.to(device).eval()\n", "    net = model.eval()\n")],
     ["DDP-wrapped model on rank 0 alone"]),
])
def test_a_classic_mistake_is_named(tmp, reference, name, edits, words):
    message = hint(launch(variant(tmp, name, *edits), tmp / name), reference)
    assert all(word in message for word in words), message


def test_fsdp_around_the_root_alone_is_named(tmp, reference):
    path = variant(tmp, "root_only", ("            fully_shard(block)\n", "            pass\n"))
    fsdp = launch(path, tmp / "root_only", "--strategy", "fsdp")
    message = hint({**reference, "fsdp": fsdp}, reference)
    assert "made 1 unit(s)" in message and "each block" in message, message


def test_a_resume_of_the_model_alone_is_named(tmp, reference):
    path = variant(tmp, "model_only", (
        '    state = {"model": model_state, "optimizer": optimizer_state,\n',
        '    state = {"model": model_state,\n'),
        ('optim_state_dict=state["optimizer"]', "optim_state_dict=optimizer_state"))
    killed = launch(path, tmp / "model_only", *KILL, ok=False)
    resumed = launch(path, tmp / "model_only")
    message = hint({**reference, "killed": killed, "resumed": resumed}, reference)
    assert "not the optimizer's state" in message, message


def test_a_rank_0_save_without_a_barrier_is_named(tmp, reference):
    path = variant(tmp, "no_barrier", (
        "    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save(",
        "    if dist.get_rank() == 0:  # the mistake: nobody waits for the file\n"
        "        torch.save(model.module.state_dict(), os.path.join(folder, f'step-{step}.pt'))\n"
        "    return\n    dcp.save("))
    killed = launch(path, tmp / "no_barrier", *KILL, ok=False)
    message = hint({**reference, "killed": killed}, reference)
    assert "while rank 0 was still writing the checkpoint" in message, message
    assert "barrier" in message


def test_a_load_without_map_location_is_named(tmp, reference):
    path = variant(tmp, "no_map_location", (
        "    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save(",
        "    if dist.get_rank() == 0:\n"
        "        torch.save(model.module.state_dict(), os.path.join(folder, 'model.pt'))\n"
        "    dist.barrier()\n"
        "    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save("), (
        "    if name is None:\n        return None\n",
        "    if name is None:\n        return None\n"
        "    torch.load(os.path.join(folder, 'model.pt'))  # the mistake\n"))
    killed = launch(path, tmp / "no_map_location", *KILL, ok=False)
    resumed = launch(path, tmp / "no_map_location")
    message = hint({**reference, "killed": killed, "resumed": resumed}, reference)
    assert "no map_location" in message and "resumed run" in message, message


def test_a_save_on_rank_0_alone_hangs_and_the_hang_is_named(tmp, reference):
    path = variant(tmp, "save_on_rank_0", (
        "                save(args.checkpoint_dir,", "                rank == 0 and save("
        "args.checkpoint_dir,"))
    result = launch(path, tmp / "hang", ok=False, timeout=60)  # a hang ends here
    message = hint(result, reference)
    assert "deadlock" in message and "at line" in message, message
    assert "save_on_rank_0.py" in message, message
