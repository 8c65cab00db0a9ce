"""ddplab.lab.script_runs (lesson 07): a terminal run's output is read only when it is newer
than the script; otherwise the script is launched, and a run that does not finish names the
line each rank was at."""

from __future__ import annotations

import os
import types

import pytest

import ddplab
from ddplab.lab import script_runs


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "whoami.py"
    path.write_text("import torch.distributed as dist\n\ndist.all_gather_object(a, b)\n"
                    "dist.barrier()\n")
    return path


def test_a_fresh_output_is_read_without_launching(script, monkeypatch):
    output = script.parent / "seen.json"
    output.write_text("[1, 2]")
    os.utime(script, (1, 1))                      # the script is older than the output
    monkeypatch.setattr(ddplab, "launch", lambda *a, **k: pytest.fail("launched"))
    assert script_runs.output_of_a_run(script, output) == "[1, 2]"


def test_an_output_older_than_the_script_is_replaced_by_a_run(script, monkeypatch):
    output = script.parent / "seen.json"
    output.write_text("stale")
    os.utime(output, (1, 1))                      # written before the script last changed

    def launch(target, nprocs, **kwargs):
        assert not output.exists()                # the stale file is gone before the run
        output.write_text("fresh")
        return types.SimpleNamespace(ok=True)

    monkeypatch.setattr(ddplab, "launch", launch)
    assert script_runs.output_of_a_run(script, output) == "fresh"


def test_a_run_that_does_not_finish_names_each_ranks_line(script, monkeypatch, capsys):
    stacks = {0: f'File "{script}", line 4 in <module>',
              1: f'File "/x/distributed_c10d.py", line 9 in all_gather_object\n'
                 f'File "{script}", line 3 in <module>'}
    monkeypatch.setattr(ddplab, "launch", lambda *a, **k: types.SimpleNamespace(
        ok=False, status="timeout", stacks=stacks))
    with pytest.raises(RuntimeError, match="did not finish"):
        script_runs.output_of_a_run(script, script.parent / "seen.json")
    out = capsys.readouterr().out
    assert "rank 0 was at line 4: dist.barrier()" in out
    assert "rank 1 was at line 3: dist.all_gather_object(a, b)" in out
