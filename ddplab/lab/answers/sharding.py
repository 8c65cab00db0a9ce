"""What exercise 11's two parts teach, shown only once the judge has said the learner's runs
are correct: the mistakes to try on the pipeline step (11), and why FSDP2's precision policy
keeps the bytes per rank (11b).

Lesson: 11.
"""

# [pipeline-step]
# Change your file and watch the verdict name the mistake: drop the weight of the last
# stage's losses, delete the requires_grad_() of the received activation, or make rank 0
# recv each gradient right after its send (a deadlock: add "--pg-timeout", "3" to the
# launch's args to end it sooner).
# [/pipeline-step]

# [fsdp2-precision]
# Why this precision policy: bfloat16 needs no loss scaling (notebook 06, section 3), and
# FSDP2 scales nothing by itself; reduce_dtype=torch.float32 keeps the average over the
# ranks from being rounded to bfloat16's 8 significant bits at every step. The policy casts
# only the gathered copies a block computes with, one block at a time: the shards, their
# gradients and Adam's moments stay float32, so the 16 bytes a parameter, divided by N,
# still hold (the table above).
# [/fsdp2-precision]
