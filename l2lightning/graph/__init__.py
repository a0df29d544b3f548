"""The captured graph and what runs around it: capture and replay of the whole step, the optimizer
made capturable (one or several, fused AdamW under 16-mixed), gradient accumulation's graphs, manual
optimization's step, the replay's closure, carried state, device scalars for Python operands,
random generators and CUDA memory.

Nothing here imports :mod:`l2lightning.callback` (tests/test_layout.py).
"""
