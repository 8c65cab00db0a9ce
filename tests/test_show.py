"""Teaching code is shown from the real files."""

import pytest

from ddplab import showcode as ddshow


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

    for module in ("launcher", "launcher.api", "launcher.results", "showcode", "checks", "env"):
        importlib.import_module(f"ddplab.{module}")
    assert callable(ddplab.launch) and callable(ddplab.show) and callable(ddplab.check)
    assert ddplab.RunResult.__name__ == "RunResult"
