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
