"""l2lightning: whole-step CUDA graphs with measured cross-layer L2 weight prefetch for PyTorch Lightning.

`Trainer(callbacks=[L2GraphCallback()])` captures forward, loss, backward and the optimizer step in
one CUDA graph; inside it a side-stream kernel warms L2 with the next layer's weights where the
autotuner measured that it pays. Importing this package touches neither CUDA nor CuPy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PrefetchPlan": "l2lightning.prefetch.plan",
    "default_plan": "l2lightning.prefetch.plan",
    "PrefetchHooks": "l2lightning.prefetch.hooks",
    "PrefetchSequential": "l2lightning.prefetch.sequential",
    "CapturedStep": "l2lightning.graph.capture",
    "capture_step": "l2lightning.graph.capture",
    "BatchMismatchError": "l2lightning.graph.capture",
    "make_capturable": "l2lightning.graph.optim",
    "OptimizerNotCapturableError": "l2lightning.graph.optim",
    "CapturableFrom": "l2lightning.baseline",
    "VerifyReport": "l2lightning.verify",
    "EquivalenceError": "l2lightning.verify",
    "assert_same_gradients": "l2lightning.verify",
    "equivalence_chain": "l2lightning.verify",
    "L2GraphCallback": "l2lightning.callback.graph_callback",
    "Autotuner": "l2lightning.tune.search",
    "DecodeSession": "l2lightning.decode.model",
    "TorchDecodeSession": "l2lightning.decode.model",
    "build_decoder": "l2lightning.decode.model",
    "choose_attention": "l2lightning.decode.attention",
    "TuningReport": "l2lightning.tune.report",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'l2lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
