"""The launch helper's adjustments to PyTorch's rendezvous: same results, less waiting."""

from __future__ import annotations

import time

import pytest

dynamic = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

from ddplab import agent  # noqa: E402


@pytest.fixture
def restore(monkeypatch):
    monkeypatch.setattr(dynamic, "_delay", dynamic._delay)
    monkeypatch.setattr(dynamic, "get_method_name", dynamic.get_method_name)


class _Recorder:
    def name_through(self, fn):
        return fn()


def test_method_name_is_read_from_the_frame_with_the_same_answer(restore):
    original = dynamic.get_method_name
    expected = _Recorder().name_through(lambda: original())
    agent._quick_rendezvous(single_node=False)
    assert dynamic.get_method_name is not original
    assert _Recorder().name_through(lambda: dynamic.get_method_name()) == expected
    assert expected == "name_through"


@pytest.fixture
def sleeps(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(time, "sleep", calls.append)
    return calls


def test_single_node_skips_only_the_random_skew_before_the_first_round(restore, sleeps):
    agent._quick_rendezvous(single_node=True)
    dynamic._delay(seconds=(0.1, 0.3))  # the skew between nodes: nothing to skew on one node
    assert sleeps == []
    dynamic._delay(seconds=1)  # the fixed wait between polls of the store is kept
    assert sleeps == [1]


def test_several_nodes_keep_the_random_skew(restore, sleeps):
    agent._quick_rendezvous(single_node=False)
    dynamic._delay(seconds=(0.1, 0.3))
    assert len(sleeps) == 1 and 0.1 <= sleeps[0] <= 0.3
