"""The line protocol between workers and the launcher."""

import json

from ddplab import events


def test_emit_prints_one_parseable_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    sent = events.emit("metric", name="loss", value=0.25)
    line = capsys.readouterr().out
    assert line.endswith("\n") and line.count("\n") == 1
    assert events.parse(line.rstrip("\n")) == sent == {
        "kind": "metric", "rank": 3, "name": "loss", "value": 0.25}


def test_ordinary_and_broken_lines_are_not_events():
    assert events.parse("loss 0.25") is None
    assert events.parse(events.MARKER + "{not json") is None
    assert events.parse(events.MARKER + json.dumps([1, 2])) is None
    assert events.parse(events.MARKER + json.dumps({"no": "kind"})) is None


def test_numpy_and_tensor_values_become_plain_json(capsys):
    import numpy as np
    import torch

    events.emit("metric", a=np.float32(1.5), b=torch.tensor([1.0, 2.0]))
    event = events.parse(capsys.readouterr().out.strip())
    assert event["a"] == 1.5 and event["b"] == [1.0, 2.0]


def test_an_event_after_a_line_without_newline_is_split_off():
    exit_event = {"kind": "exit", "rank": 1, "code": 0, "time": 1.5}
    glued = "progress 99%" + events.MARKER + json.dumps(exit_event)
    assert events.split(glued) == ("progress 99%", exit_event)
    assert events.split(events.MARKER + json.dumps(exit_event)) == ("", exit_event)
    assert events.split("loss 0.25") == ("loss 0.25", None)
    # Text that merely contains the marker is output, not an event.
    odd = "see " + events.MARKER + "{not json"
    assert events.split(odd) == (odd, None)
    not_an_event = "x" + events.MARKER + json.dumps([1])
    assert events.split(not_an_event) == (not_an_event, None)


def test_reserved_kinds_and_odd_ranks_are_events_only_when_well_formed():
    """``exit``, ``report`` and ``round`` are the launcher's own: one missing a field, or with
    a field of the wrong type, is an ordinary line (a rank's output never breaks the caller)."""
    line = events.MARKER.__add__
    assert events.parse(line('{"kind": "exit", "rank": 1, "code": 0, "time": 2.5}'))
    assert events.parse(line('{"kind": "exit", "rank": 1, "code": 0, "time": 2}'))
    for text in ('{"kind": "exit"}', '{"kind": "exit", "code": 0, "time": 1.0}',
                 '{"kind": "exit", "rank": 0, "code": "0", "time": 1.0}',
                 '{"kind": "exit", "rank": true, "code": 0, "time": 1.0}',
                 '{"kind": "report"}', '{"kind": "report", "status": 1}',
                 '{"kind": "metric", "rank": "0"}', '{"kind": "metric", "rank": 1.5}',
                 '{"kind": 3}'):
        assert events.parse(line(text)) is None, text
    assert events.parse(line('{"kind": "report", "status": "ok"}'))
    assert events.parse(line('{"kind": "round"}')) == {"kind": "round"}
    assert set(events.RESERVED) == {"exit", "report", "round"}


def test_a_result_keeps_the_newest_lines_and_says_how_many_went(monkeypatch):
    from ddplab.launcher import output

    monkeypatch.delenv("DDPLAB_KEEP_LINES", raising=False)
    assert output.Streams([], None).keep == output.KEEP_LINES  # capped by default
    monkeypatch.setenv("DDPLAB_KEEP_LINES", "3")
    streams, lines = output.Streams([], None), []
    for index in range(20):
        streams._keep(lines, f"line {index}")
    said = lines[0]
    assert said.startswith("[ddplab: ") and said.endswith(" earlier lines not kept]")
    assert int(said.split()[1]) + len(lines) - 1 == 20  # nothing lost without a word
    assert lines[-1] == "line 19" and len(lines) <= 6


def test_a_launch_runs_cold_where_its_environment_cannot_reach_a_forked_rank(monkeypatch):
    """A watchdog thread torch's agent would start, or a request too large for the helper's
    socket: such a launch runs as a cold torchrun, and says why."""
    import os

    from ddplab.launcher.jobs import child_env, fork_changes

    base = child_env(os.environ)
    assert fork_changes(base) is None
    assert "TORCHELASTIC_ENABLE_FILE_TIMER" in fork_changes(
        {**base, "TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    assert "too large" in fork_changes({**base, "BIG": "x" * 300_000})
