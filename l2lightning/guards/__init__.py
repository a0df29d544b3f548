"""What may change between steps and how each is read: whether a replay still stands for the eager
step. The step's source and its warm-up trace, the Python state and values it reads, the batch's
parts it reads, modules' flags, torch's numerics settings, bound metrics and re-issued logs, the
progress bar's reads, and the sampled replay check that compares replays with eager steps.

Nothing here imports :mod:`l2lightning.callback` (tests/test_layout.py).
"""
