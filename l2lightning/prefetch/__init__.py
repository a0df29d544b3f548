"""Cross-layer L2 weight prefetch: plans, the layer chain, the hooks that issue prefetches, the kernels.

``plan`` (what one prefetch does, and the one resolver from a prefetch setting to per-layer plans),
``chain`` (the weight-reading layers of a model in execution order), ``install`` (hooks that issue
the plans they are given), ``hooks`` (``PrefetchHooks``: a setting, tuned or not, resolved and
installed), ``sequential``, ``ops`` (the custom ops ``torch.compile`` traces) and ``kernels`` (the
CuPy launches). The package imports nothing at import time: importing it touches neither CUDA nor CuPy.
"""
