"""ddplab.lab.script_runs (lessons 07, 07b): a terminal run's output is read only when it is
newer than the script; otherwise the script is launched, and a run that does not finish names
the line each rank was at. Terminal logs are read for their events, or not at all."""

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


def test_terminal_logs_give_their_events_or_none_when_a_terminal_has_not_run(tmp_path):
    one, two = tmp_path / "terminal_1.log", tmp_path / "terminal_2.log"
    one.write_text('W1129 a warning\n@ddplab {"kind": "joined", "rank": 0}\n'
                   '[default1]:@ddplab {"kind": "joined", "rank": 1}\n'
                   '@ddplab {"kind": "metric", "rank": 0}\n@ddplab not json\n')
    assert script_runs.terminal_events([one, two], "joined") is None        # two never ran
    two.write_text("rank 2 joined\n")
    assert script_runs.terminal_events([one, two], "joined") is None        # no event in it
    two.write_text('@ddplab {"kind": "joined", "rank": 2}\n')
    found = script_runs.terminal_events([one, two], "joined")
    assert {name: [e["rank"] for e in evs] for name, evs in found.items()} == {
        "terminal_1": [0, 1], "terminal_2": [2]}
