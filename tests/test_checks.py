"""Every exercise (01-09, 07b, 09b, 12) accepts its reference answer, rejects a wrong one, and
says why."""

from __future__ import annotations

import math

import pytest
import torch

from ddplab.lab.checks import EXERCISES, check, reference_answer
from ddplab.lab.demos.dataparallel import scatter_sizes

WRONG = {"01": 1000 / 1.16, "02": lambda batch, gpus: max(0, gpus - batch),
         "03": (1024, 0.001), "04": (168, 0),
         "05": [3, 4, 5], "06": (torch.float16, torch.float16, torch.float32), "07": [0, 1, 2, 3],
         "07b": ["bravo", "charlie"], "08": 100,
         "09": 14.0 / 2.5, "09b": 8 * (128 * 1024 * 4 + 5056) + 5120, "12": (1, 1, 1, 1)}


def test_every_notebook_has_one_exercise():
    assert sorted(EXERCISES) == [*(f"{n:02d}" for n in range(1, 8)), "07b", "08", "09", "09b",
                                 "12"] == sorted(WRONG)


@pytest.mark.parametrize("key", sorted(WRONG))
def test_reference_is_accepted_and_a_wrong_answer_rejected(key, capsys):
    right, wrong = check(key, reference_answer(key)), check(key, WRONG[key])
    assert bool(right) is True and bool(wrong) is False
    assert right.message.endswith("correct!") and "not yet" in wrong.message
    assert capsys.readouterr().out.splitlines() == [right.message, wrong.message]


@pytest.mark.parametrize("key", sorted(WRONG))
def test_unanswered_exercise_asks_the_question(key, capsys):
    verdict = check(key, None)
    assert bool(verdict) is False
    assert "not answered yet" in capsys.readouterr().out


def test_a_verdict_in_a_notebook_adds_no_output_cell_of_its_own():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    formatted, _metadata = shell.display_formatter.format(check("01", None))
    assert formatted == {}  # Jupyter shows the printed message only, no "Out: False"


def test_reference_answers_are_what_the_lessons_teach():
    assert reference_answer("01") == pytest.approx(1000 / 1.1)   # samples / median of 2-6
    idle_gpus = reference_answer("02")                           # the rule, as a function
    assert [b for b in range(1, 13) if idle_gpus(b, 4)] == [1, 2, 3, 5, 6, 9]   # 9: 3 chunks of 3
    assert all(idle_gpus(b, g) == g - len(scatter_sizes(b, g))   # Tensor.chunk, as DataParallel
               for b in range(1, 200) for g in range(1, 33))
    assert reference_answer("03") == (192, pytest.approx(0.12))   # 16 x 4 x 3; 0.02 x 192 / 32
    assert reference_answer("04") == (169, 5)
    # layer_norm is on no CPU autocast list (CUDA's float32 one): it keeps its input's dtype;
    # float32 + float16 promotes to float32
    assert reference_answer("06") == (torch.float32, torch.float16, torch.float32)
    assert reference_answer("07") == [4, 5, 6, 7]      # no argument: the default reads RANK
    assert reference_answer("07b") == ["alpha", "bravo"]         # --node-rank 0: charlie
    assert reference_answer("08") == 200        # (n - 1) M / (2 (n - 1) / n M) = n / 2 >= 100
    assert reference_answer("09") == pytest.approx(10 * 14.0 / (13 * 2.5))   # time to the target
    # 8 blocks keep their input (B x W floats) and the RNG state; the loss its log-probabilities
    # every block's output, the 4 plain blocks' GELU inputs, the 4 checkpointed ones' RNG state
    assert reference_answer("09b") == (8 + 4) * 128 * 1024 * 4 + 4 * 5056 + 128 * 10 * 4
    assert reference_answer("12") == (3, 1, 1, 3)   # q, k, v gather, out scatters; backward mirrors


def test_hints_name_the_mistake(capsys):
    check("01", 1000 / 1.175)                     # warm-up epoch included (median of six)
    assert "warm-up" in capsys.readouterr().out
    check("01", 16 * 64 / 1.1)                    # 16 full batches: the last one has 40
    hint = capsys.readouterr().out
    assert "batches full" in hint and "40" not in hint
    check("01", 64 / 0.021)                       # the step clock read without synchronize()
    hint = capsys.readouterr().out
    assert "synchronize()" in hint and "epoch" not in hint
    check("01", 1000 / 1.17)                      # the mean of the timed epochs
    assert "median" in capsys.readouterr().out
    check("02", [1, 2, 3, 5, 6, 9])               # the old question's list, not the rule
    assert "your function" in capsys.readouterr().out
    check("02", lambda batch, gpus: gpus - len(scatter_sizes(batch, gpus)))   # the tool, no rule
    assert "in arithmetic" in capsys.readouterr().out
    check("02", lambda batch, gpus: max(0, gpus - batch))   # only batches smaller than the GPUs
    hint = capsys.readouterr().out
    assert "larger than the GPU count" in hint and "//" not in hint
    check("02", lambda batch, gpus: gpus - math.ceil(batch / (batch // gpus + 1)))   # chunk + 1
    assert "divides by the GPU count" in capsys.readouterr().out
    check("02", lambda batch, gpus: 0 if batch % gpus == 0 else 1)   # wrong beyond the divisors
    hint = capsys.readouterr().out
    assert "scatter_sizes(3, 2)" in hint and "ceil" not in hint
    check("02", lambda batch, gpus: 1 / 0)
    assert "raised ZeroDivisionError" in capsys.readouterr().out
    check("03", (64, 0.12))                       # the micro-batches left out
    hint = capsys.readouterr().out
    assert "micro-batches" in hint and "192" not in hint
    check("03", (192, 0.24))                      # x world size x micro-batches, as --scale-lr
    hint = capsys.readouterr().out
    assert "tuned batch" in hint and "0.12" not in hint
    check("06", (torch.float16, torch.float16, torch.float32))   # everything taken to be 16-bit
    hint = capsys.readouterr().out
    assert "low-precision list" in hint and "float" not in hint
    check("06", ("float32", "float32", "float32"))   # layer_norm taken to be CUDA's float32 op
    hint = capsys.readouterr().out
    assert "CUDA's lists differ" in hint and "float" not in hint
    check("06", ("float32", "float16", "float16"))   # the residual taken to stay 16-bit
    hint = capsys.readouterr().out
    assert "type promotion" in hint and "float" not in hint
    check("06", (torch.float32, torch.float16))      # two dtypes: an older question's shape
    assert "three dtypes" in capsys.readouterr().out
    check("07", [0, 1, 2, 3])                     # what the old launcher gave, not torchrun
    hint = capsys.readouterr().out
    assert "old launcher" in hint and "4" not in hint and "default" not in hint
    check("07", [0, 0, 0, 0])                     # the default taken to be 0 everywhere
    hint = capsys.readouterr().out
    assert "own environment" in hint and "RANK\"" not in hint and "4" not in hint
    check("07b", ["bravo", "charlie"])            # numbered as c10d would: alpha sorts first
    hint = capsys.readouterr().out
    assert "--rdzv-backend" in hint and "section 2" in hint
    assert "charlie" not in hint and "static" not in hint   # a hint, not the way to the answer
    assert "node-rank" not in hint
    check("07b", [])                              # as if /scratch were shared
    assert "own disk" in capsys.readouterr().out
    check("12", (1, 1, 1, 1))                     # the demonstration's block, one gather
    hint = capsys.readouterr().out
    assert "its own style" in hint and "3" not in hint   # a hint, not the count
    check("12", (3, 1, 3, 1))                     # backward taken to repeat the forward
    assert "does not repeat" in capsys.readouterr().out
    check("12", (3, 1, 0, 0))                     # backward taken to be free
    assert "backward communicates too" in capsys.readouterr().out
    check("09", 14.0 / 2.5)                       # one epoch's speed-up, not time to the target
    assert "one epoch" in capsys.readouterr().out
    check("09", 14.0 / 2.5 / 8)                   # the per-epoch efficiency
    assert "an efficiency" in capsys.readouterr().out
    check("09", 13 / 10)                          # epochs compared, not the time they take
    hint = capsys.readouterr().out
    assert "not a number of epochs" in hint and "4.3" not in hint
    check("09b", 8 * 2 * 128 * 1024 * 4 + 5120)   # no block checkpointed
    assert "no block checkpointed" in capsys.readouterr().out
    check("09b", 8 * (128 * 1024 * 4 + 5056) + 5120)   # every block checkpointed
    assert "every block checkpointed" in capsys.readouterr().out
    check("09b", 12 * 128 * 1024 * 4 + 5120)      # the RNG state forgotten
    hint = capsys.readouterr().out
    assert "one more thing" in hint and "5056" not in hint and "RNG" not in hint
    check("09b", 12 * 128 * 1024 * 4 + 4 * 5056)  # the loss's log-probabilities forgotten
    assert "the loss keeps" in capsys.readouterr().out
    check("09b", 10 * 128 * 1024 * 4 + 4 * 5056 + 5120)   # a block's output left out
    hint = capsys.readouterr().out
    assert "one tensor at a time" in hint and "12" not in hint
    check("09b", 4.04)                            # MiB
    assert "in bytes" in capsys.readouterr().out
    check("08", 100)                              # the server's link both ways vs ring sends
    assert "same directions" in capsys.readouterr().out
    check("08", 101)                              # a ring process's share taken as M
    assert "2 (n - 1) / n M" in capsys.readouterr().out


def test_answers_in_other_spellings():
    assert check("02", lambda b, g: g - math.ceil(b / math.ceil(b / g)))
    assert check("03", [192, "0.12"])
    assert check("05", (4, 5)) and check("06", ("float32", "float16", "float32"))
    assert check("07", ("4", "5", "6", "7")) and check("08", "200") and check("09", "4.31")
    assert check("09b", "6316800") and not check("09b", "4 MiB")
    assert check("12", ["3", "1", "1", "3"]) and not check("12", 3)
    assert not check("01", "fast") and not check("03", 1024) and not check("04", "169")
    assert not check("08", "a lot") and not check("09", 1.5)


def test_the_example_in_checks_docstring_is_judged_as_its_comment_says(capsys):
    """The docstring shows a wrong warm-up answer (a right one would answer an exercise where
    Shift-Tab shows it), and the judge does reject it."""
    import ast
    import re

    from ddplab.lab import checks

    example = re.search(r'ddplab\.check\("(\d+b?)", (\[.*?\]|\(.*?\))\) +# a warm-up answer: (.*)',
                        checks.check.__doc__)
    assert example, "check's docstring should show a warm-up answer"
    key, answer, said = example.groups()
    assert "why not" in said and not check(key, ast.literal_eval(answer))


def test_exercise_07_is_torchs_reading_of_both_launchers():
    """The reference comes from torch's torchrun code; the same parser, in the same processes,
    under the old launcher (which appends --local-rank=N) reads every worker's local rank."""
    from ddplab.lab import checks, cmdlines

    node1 = [checks.question_07_environ(1, r) for r in range(4)]
    old = [checks.question_07_parser(env).parse_args(
        cmdlines.legacy_script_argv(local_rank=r, nproc_per_node=4)).local_rank
        for r, env in enumerate(node1)]
    assert old == [0, 1, 2, 3] != reference_answer("07")
    assert [int(env["RANK"]) for env in node1] == reference_answer("07")   # the default: RANK
    assert cmdlines.torchrun_config(checks.QUESTION_07_TORCHRUN)["script_args"] == []


def test_07b_reference_is_how_torch_numbers_the_static_nodes():
    """The exercise's command names no --rdzv-backend: torch's own parser gives it the static
    rendezvous, whose StaticTCPRendezvous hands each agent its --node-rank as GROUP_RANK; three
    such agents meet here on the loopback, and every machine but GROUP_RANK 0's lacks the file."""
    import threading

    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from ddplab.env import free_port
    from ddplab.lab import checks, cmdlines

    hosts = checks.QUESTION_07B_NODE_RANKS
    assert all(host in EXERCISES["07b"].question for host in hosts)
    configs = {host: cmdlines.torchrun_config(checks.question_07b_torchrun(node))["config"]
               for host, node in hosts.items()}
    assert {config["rdzv_backend"] for config in configs.values()} == {"static"}
    port, ranks = free_port(), {}

    def join(host: str) -> None:   # the agent of one machine, with the rank its config gives
        rdzv = StaticTCPRendezvous("127.0.0.1", port, configs[host]["rdzv_configs"]["rank"],
                                   len(hosts), "job7", timeout=60)
        ranks[host] = rdzv.next_rendezvous().rank

    threads = [threading.Thread(target=join, args=(host,)) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert sorted(ranks.values()) == [0, 1, 2] and ranks["alpha"] != 0   # not the first to start
    assert sorted(host for host, rank in ranks.items() if rank != 0) == reference_answer("07b")
