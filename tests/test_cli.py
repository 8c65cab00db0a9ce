"""python -m ddplab: every subcommand answers, and options reach course and bench.

The command itself runs as a process where a process is the point (the doctor, usage errors,
Ctrl-C in a terminal, the ranks' streams on the command's own stdout and stderr;
test_cuda_clean's cold command). Where the point is what ``launch``'s options reach and what
it prints, the command's ``main(argv)`` runs in this process (the ``cli`` fixture,
tests/conftest.py): the same parser, launch and report, through the session's warm launch
helper instead of a cold one per command."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def ddplab(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ddplab", *args], capture_output=True,
                          text=True, timeout=timeout)



def test_doctor_succeeds_and_prints_the_full_report():
    from ddplab import env

    done = ddplab("doctor")
    assert done.returncode == 0, done.stderr
    assert f"lessons run          {env.course_plan(env.probe())}" in done.stdout
    assert len(done.stdout.splitlines()) > 10   # every fact, not the notebooks' one line


@pytest.mark.parametrize("command,option", [("course", "--strip"), ("bench", "--repeats")])
def test_course_and_bench_take_their_own_options(command, option):
    done = ddplab(command, "--help")
    assert done.returncode == 0 and option in done.stdout


def test_unknown_command_is_a_usage_error():
    done = ddplab("fly")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_max_restarts_reaches_the_elastic_agent(cli):
    script = str(Path(__file__).parent / "scripts" / "restart_once.py")
    failed = cli("launch", "--nproc-per-node", "2", script)
    assert failed.returncode != 0 and "rank 1 exited with code 5" in failed.stderr
    restarted = cli("launch", "--nproc-per-node", "2", "--max-restarts", "1", script)
    assert restarted.returncode == 0, restarted.stderr
    assert "[rank1] attempt 1: rank 1 sum 3" in restarted.stdout


SCRIPTS = Path(__file__).parent / "scripts"


def test_training_worker_prints_its_epochs_and_summary_and_json_holds_the_result(tmp_path, cli):
    out = tmp_path / "result.json"
    done = cli("launch", "--nproc-per-node", "2", "--json", str(out),
               "ddplab/workers/train.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"]
    assert all("loss" in line and "accuracy" in line and " s (" in line for line in epochs)
    summary = [line for line in lines if line.startswith("summary: ")]
    assert len(summary) == 1 and "trained on 2 process(es)" in summary[0]
    saved = json.loads(out.read_text())
    assert saved["status"] == "ok" and saved["exit_codes"] == {"0": 0, "1": 0}
    assert saved["root_cause"] is None
    assert f"test accuracy {saved['summary']['final_accuracy']:.1%}" in summary[0]
    assert [e["epoch"] for e in saved["events"]["0"] if e["kind"] == "epoch"] == [1, 2]
    assert "@ddplab" not in done.stdout + done.stderr


def test_json_of_a_failed_run_names_the_root_cause(tmp_path, cli):
    out = tmp_path / "result.json"
    done = cli("launch", "--nproc-per-node", "2", "--json", str(out),
               str(SCRIPTS / "faulty.py"), "exit")
    assert done.returncode == 1 and "rank 1 exited with code 3" in done.stderr
    saved = json.loads(out.read_text())
    assert saved["status"] == "failed" and saved["exit_codes"]["1"] == 3
    assert saved["root_cause"]["rank"] == 1 and saved["root_cause"]["exitcode"] == 3


def test_ranks_stderr_goes_to_stderr_and_stdout_to_stdout():
    env = {**os.environ, "DDPLAB_LAUNCH_PATH": "subprocess"}
    done = subprocess.run([sys.executable, "-m", "ddplab", "launch", "--nproc-per-node", "2",
                           str(SCRIPTS / "streams.py")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank{rank}] out line of rank {rank}\n" in done.stdout
        assert f"[rank{rank}] progress 99%\n" in done.stdout
        assert f"[rank{rank}] err line of rank {rank}\n" in done.stderr
    assert "err line" not in done.stdout and "out line" not in done.stderr


def test_ctrl_c_ends_the_job_and_exits_130(exit_within):
    # ``python -m ddplab launch ...`` with Python's SIGINT handler, which a terminal's Ctrl-C
    # finds; started from a background test run, SIGINT would be inherited as ignored.
    ctrl_c_able = ("import runpy, signal, sys; signal.signal(signal.SIGINT, "
                   "signal.default_int_handler); sys.argv[0] = 'ddplab'; "
                   "runpy.run_module('ddplab', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", ctrl_c_able, "launch", "--nproc-per-node", "2",
                             str(SCRIPTS / "faulty.py"), "sleep"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = ""
        while len(re.findall(r"\bpid (\d+)", seen)) < 2:
            line = proc.stdout.readline()
            assert line, f"the launch ended early: {proc.stderr.read()}"
            seen += line
        pids = [int(p) for p in re.findall(r"\bpid (\d+)", seen)]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _out, err = exit_within(proc, 60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted: every process of the job was ended" in err
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_local_rank_arg_passes_each_rank_its_local_rank(tmp_path, cli):
    script = tmp_path / "legacy.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--local_rank', type=int, default=-1)\n"
                      "p.add_argument('--lr', type=float)\n"
                      "a = p.parse_args()\nprint('local_rank', a.local_rank, 'lr', a.lr)\n")
    plain = cli("launch", "--nproc-per-node", "2", str(script), "--lr", "0.5")
    assert plain.returncode == 0 and plain.stdout.count("local_rank -1 lr 0.5") == 2
    passed = cli("launch", "--nproc-per-node", "2", "--local-rank-arg", str(script),
                 "--lr", "0.5")
    assert passed.returncode == 0, passed.stderr
    assert "[rank0] local_rank 0 lr 0.5" in passed.stdout
    assert "[rank1] local_rank 1 lr 0.5" in passed.stdout
