"""The measured autotuner: which prefetch plan pays for each layer shape, decided by timing.

``search`` (the :class:`~l2lightning.tune.search.Autotuner` and its staged race), ``candidates``
(the plan grid and the pruning rule), ``throwaway`` (copies of a layer's block to time on),
``timing`` (CUDA-graph timing of one shape), ``memory`` (what the throwaway chains hold, and the
budget they must fit in), ``report`` (the tuning table), ``stats`` (the confidence intervals and
the gate) and ``cache`` (decisions kept on disk). The core's prefetch package calls the tuner
only through :mod:`l2lightning.prefetch.hooks`; the tuner never imports it.
"""
