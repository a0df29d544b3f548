"""Graph-captured LLM decode steps with L2 weight prefetch (an optional feature of the library).

``model`` (the Llama-style decoder and its configs), ``session`` (``DecodeSession``: one CUDA graph
per cache-length bucket), ``reference`` (numerics against an FP32 copy), ``step_report`` (where a
decode step's time goes) and ``attention`` (the split-K decode attention kernel and its choice).
"""
