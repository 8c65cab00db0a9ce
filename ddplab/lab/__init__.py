"""What only the notebooks call: live views and plots, code shown from the real files, exercise
checks and their judges, in-kernel demonstrations, post-mortems, the course runner, the
benchmark of lesson 09 and the SLURM and command-line helpers of lessons 07 and 07b (kernel side).

The launcher is in :mod:`ddplab.launcher`; the training library students copy (``dist``,
``checkpoint``, ``train``, ...) and the worker scripts stay at the top of the package.
"""
