"""The course's answers to exercises, shown by a notebook only once the judge has said the
learner's run is correct (kernel side: nothing here imports a ddplab module).

Lessons: 10 (running_loss), 12 (tensor_parallel).
"""
