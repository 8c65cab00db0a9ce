"""DDP's buckets on two real gloo processes: one all-reduce per bucket, sent while backward still
computes the earlier layers' gradients (the overlap lesson 03 claims)."""

from __future__ import annotations

import pytest

import ddplab
from ddplab.lab.judges import metric

pytestmark = pytest.mark.slow


def test_each_bucket_is_sent_before_backward_has_every_gradient():
    run = ddplab.launch("ddplab.workers.buckets", 2, args=["--layers", "4"], quiet=True,
                        live=False, timeout=300)
    buckets, parameters = metric(run.check(), "buckets"), metric(run, "parameters")
    for rank in (0, 1):
        sent = buckets[rank]
        assert len(sent) == 4 and sum(b["parameters"] for b in sent) == parameters[rank] == 8
        assert sent[0]["waiting"] == 6 and [b["waiting"] for b in sent] == [6, 4, 2, 0]
    bigger = ddplab.launch("ddplab.workers.buckets", 2, args=["--layers", "4", "--bucket-cap-mb",
                                                              "25"], quiet=True, live=False,
                           timeout=300)
    assert [len(v) for v in metric(bigger.check(), "buckets").values()] == [1, 1]  # one bucket
