"""What a launch shows while it runs: prefixed lines, the progress bar, the loss points."""

from ddplab.liveview import LiveView, loss_png


def progress(step, epoch=1, loss=1.0, rank=0):
    return {"kind": "progress", "rank": rank, "epoch": epoch, "epochs": 2, "step": step,
            "steps": 10, "loss": loss}


def test_lines_are_prefixed_and_quiet_prints_nothing(capsys):
    LiveView().line("rank1", "hello")
    LiveView(quiet=True).line("rank1", "hidden")
    assert capsys.readouterr().out == "[rank1] hello\n"


def test_bar_follows_rank0_progress_without_lag():
    view = LiveView()
    view.event(progress(3))
    assert view.bar.total == 20 and view.bar.n == 3
    view.event(progress(5, rank=1))                     # other ranks do not drive the bar
    assert view.bar.n == 3
    view.event(progress(4, epoch=2, loss=0.5))
    assert view.bar.n == 14
    assert view.losses == [(0.3, 1.0), (1.4, 0.5)]      # fractional epochs, even within one
    view.close()
    assert view.bar is None


def test_epoch_losses_are_used_when_progress_has_none():
    view = LiveView()
    view.event({"kind": "epoch", "rank": 0, "epoch": 1, "loss": 0.9})
    view.event({"kind": "epoch", "rank": 0, "epoch": 2, "loss": 0.4})
    assert view.losses == [(1.0, 0.9), (2.0, 0.4)]


def test_quiet_view_has_no_bar():
    view = LiveView(quiet=True)
    view.event(progress(3))
    assert view.bar is None and view.losses == []


def test_the_loss_plot_ticks_whole_epochs_only():
    from ddplab.liveview import loss_figure

    for points in ([(3.0, 1.0)], [(1.0, 1.0), (1.5, 0.8), (2.0, 0.6)]):
        ax = loss_figure(points).axes[0]
        ax.figure.canvas.draw()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks


def test_loss_png_is_a_png():
    assert loss_png([(0.5, 1.0), (1.0, 0.5)]).startswith(b"\x89PNG")


def test_a_notebooks_first_launch_prints_the_doctors_plan_once(monkeypatch, capsys):
    from ddplab import env
    from ddplab import liveview as widgets

    monkeypatch.setattr(widgets, "_PLAN_SHOWN", [])
    LiveView()                                           # outside Jupyter: nothing
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    LiveView(quiet=True)                                 # a quiet launch shows nothing
    LiveView(plan=False)                                 # nor a one-process launch
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(env, "PLAN_PRINTED", [])
    LiveView()
    LiveView()
    plan = env.course_plan(env.probe())
    assert capsys.readouterr().out == f"ddplab: lessons run {plan} unless a cell asks for more\n"


def test_no_launch_repeats_the_plan_a_doctor_printed_in_this_kernel(monkeypatch, capsys):
    from ddplab import env
    from ddplab import liveview as widgets

    monkeypatch.setattr(widgets, "_PLAN_SHOWN", [])
    monkeypatch.setattr(env, "PLAN_PRINTED", [])
    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    env.doctor()                                         # a notebook's first cell
    assert "lessons run" in capsys.readouterr().out
    LiveView()                                           # its first launch: said already
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(env, "PLAN_PRINTED", [])         # a new kernel
    env.doctor(quiet=True)                               # whose doctor printed nothing
    LiveView()
    assert "lessons run" in capsys.readouterr().out
