"""Teaching code is shown from the real files."""

import pytest

from ddplab.lab import showcode as ddshow


def test_section_is_cut_and_dedented():
    text = ddshow.source("ddplab.workers.train", "setup")
    assert text.splitlines()[1] == "info = dist.setup()"
    assert "# [" not in text


def test_missing_section_lists_the_existing_ones():
    with pytest.raises(KeyError, match="sections: setup, data, model, loop, cleanup"):
        ddshow.source("ddplab/workers/train.py", "nope")


def test_objects_and_missing_files():
    assert ddshow.source(ddshow.source).startswith("def source(")
    with pytest.raises(FileNotFoundError):
        ddshow.source("no/such/file.py")


def test_show_prints_outside_jupyter(capsys):
    ddshow.show("ddplab.workers.train", "cleanup")
    assert "dist.cleanup()" in capsys.readouterr().out


def test_package_names_stay_functions_after_submodule_imports():
    import importlib

    import ddplab

    for module in ("launcher", "launcher.api", "launcher.results", "lab.showcode", "lab.checks", "env"):
        importlib.import_module(f"ddplab.{module}")
    assert callable(ddplab.launch) and callable(ddplab.show) and callable(ddplab.check)
    assert ddplab.RunResult.__name__ == "RunResult"


def test_side_by_side_puts_each_files_section_in_its_column(capsys):
    files = {"DDP": "ddplab/workers/loop_ddp.py", "Fabric": "ddplab/workers/loop_fabric.py"}
    table = ddshow.side_by_side(files, ["setup", "loop"])
    assert table.count("<tr>") == 3 and "<th style='text-align:left'>Fabric</th>" in table
    assert "fabric.backward(loss)" in table and "loss.backward()" in table
    out = capsys.readouterr().out
    assert out.index("--- setup: DDP") < out.index("--- setup: Fabric") < out.index("--- loop: DDP")
    with pytest.raises(KeyError, match="sections"):
        ddshow.side_by_side(files, ["nope"])


def test_who_writes_counts_code_not_comments(tmp_path):
    """A name only in a comment is not written; each call counts once per "name(" in code."""
    plain, lib = tmp_path / "plain.py", tmp_path / "lib.py"
    plain.write_text("# [save]\nif rank == 0:\n    torch.save(m, p)\ndist.barrier()\n# [/save]\n")
    lib.write_text("# [save]\nacc.wait()\nacc.save(m, p)  # rank == 0 inside, dist.barrier(\n"
                   "acc.wait()\n# [/save]\n")
    rows = ddshow.who_writes({"plain": plain, "lib": lib}, ["save"], ["rank == 0"],
                             {"barrier": {"plain": "dist.barrier", "lib": "acc.wait"}})
    assert rows == [{"written by you": "rank == 0", "plain": "yes", "lib": "-"},
                    {"written by you": "a barrier (calls)", "plain": "dist.barrier x1",
                     "lib": "acc.wait x2"}]
