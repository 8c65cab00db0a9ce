"""What exercise 2 of lesson 04 leads to, shown only once the judge has said the learner's run
is correct: what becomes of the samples ``drop_last`` leaves out, with and without set_epoch.

Lesson: 04.
"""

# [left-out]
# With drop_last=True and no set_epoch, the tail the sampler cuts is the same in every epoch,
# so those samples (N mod world_size of them) are never trained on at all; with set_epoch
# every sample gets its turn. The hidden cell below counts both over section 5's 30 epochs.
# [/left-out]
