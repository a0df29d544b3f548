"""Graph-captured LLM decode steps with L2 weight prefetch (an optional feature of the library).

The decode step: ``config`` (the decoder layouts and the bytes a step must move), ``elementwise``
(RMSNorm, rotary, SiLU-gate), ``decoder`` (the Llama-style model), ``state`` (KV cache and layer
recorder), ``session`` (``DecodeSession``: one CUDA graph per cache-length bucket), ``numerics`` and
``reference`` (numerics against an FP32 copy), ``kernel_attribution`` and ``step_report`` (where a
decode step's time goes), ``timing`` (how all of it is timed).

Decode attention: ``checks`` (the implementations' common signature), ``kernel`` (the one-launch
split-K kernel), ``torch_attention`` (the SDPA path), ``flashinfer_adapter`` (FlashInfer's decode,
where it imports), ``backends`` (an implementation bound to a length bucket), ``choice`` (the
measured choice among them), ``sanitize`` (the kernel's compute-sanitizer workload).

``model`` and ``attention`` gather those names where callers import them from. Importing any of
these modules loads neither CuPy nor FlashInfer and does not initialise CUDA.
"""
