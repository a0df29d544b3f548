"""GPU: the decode step against the FP32 reference (issue 18). On two small combinations (4-layer
SmolLM2 and Qwen2.5 layouts at 96 and 150 cached tokens, batch 2, 8 random cache + token draws),
DecodeSession with the attention kernel is no further from FP32 than the compiled-SDPA baseline
(within 10%), for the logits and for each layer's attention operation, and its attention output is
at the bf16 rounding floor. And the step report of a small decode step attributes its kernels to
layers and parts."""

from __future__ import annotations

import json
import statistics

import pytest

from l2lightning._env import cupy_unavailable_reason
from l2lightning.decode.model import (
    QWEN25_05B,
    SMOLLM2_135M,
    DecodeSession,
    Fp32Reference,
    TorchDecodeSession,
    build_decoder,
    compare_with_reference,
    decode_step_report,
)

pytestmark = pytest.mark.gpu
needs_cupy = pytest.mark.skipif(
    cupy_unavailable_reason() is not None, reason="the attention kernel needs CuPy"
)

LAYERS, BATCH, SAMPLES, MAX_LEN = 4, 2, 8, 256
TOLERANCE = 1.10


@needs_cupy
@pytest.mark.parametrize(
    "config,context", [(SMOLLM2_135M, 96), (QWEN25_05B, 150)], ids=["smollm2-96", "qwen2.5-150"]
)
def test_kernel_step_is_no_further_from_fp32_than_the_baseline(config, context):
    model = build_decoder(config, layers=LAYERS, device="cuda", seed=0)
    sessions = {
        "ours": DecodeSession(model, BATCH, MAX_LEN, attention="kernel", prefetch=None, record_layers=True),
        "baseline": TorchDecodeSession(model, BATCH, MAX_LEN, record_layers=True),
    }
    reference = Fp32Reference(model, BATCH, MAX_LEN)
    res = compare_with_reference(sessions, reference, context, samples=SAMPLES, seed=context)
    ours, base = res["ours"], res["baseline"]
    op_ours, op_base = statistics.fmean(ours["attn_op_rel_err"]), statistics.fmean(base["attn_op_rel_err"])
    floor = statistics.fmean(ours["attn_op_rounding_floor"])
    print(
        f"{config.name}@{context}: logits ours {ours['logits_rel_err']:.4f} baseline {base['logits_rel_err']:.4f}; "
        f"attention op ours {op_ours:.5f} baseline {op_base:.5f} floor {floor:.5f}; "
        f"per layer ours {[round(x, 5) for x in ours['attn_op_rel_err']]} baseline {[round(x, 5) for x in base['attn_op_rel_err']]}"
    )
    # the attention operation: FP32 accumulation, one rounding to bf16 at the end
    assert op_ours <= 1.25 * floor, f"kernel attention {op_ours:.3g} vs bf16 rounding floor {floor:.3g}"
    for i, (a, b) in enumerate(zip(ours["attn_op_rel_err"], base["attn_op_rel_err"])):
        assert a <= TOLERANCE * b, f"layer {i}: attention op error ours {a:.3g} vs baseline {b:.3g}"
    # the whole step
    assert ours["logits_rel_err"] <= TOLERANCE * base["logits_rel_err"], (
        f"logits: ours {ours['logits_rel_err']:.4g} vs baseline {base['logits_rel_err']:.4g}"
    )
    assert ours["logits_rel_err"] < 0.05


@needs_cupy
def test_step_report_attributes_the_kernels_to_layers_and_parts():
    model = build_decoder(SMOLLM2_135M, layers=2, device="cuda", seed=0)
    session = DecodeSession(model, BATCH, MAX_LEN, attention="kernel", prefetch=None)  # shapes compiled above
    rep = decode_step_report(session, 100, copy_bw=4e12, empty_kernel_us=2.0)
    print(rep["text"])
    print(json.dumps({k: rep[k] for k in ("attribution", "time_source", "graph", "kernels_per_step")}))
    assert rep["attribution"] in ("correlation", "order")
    roles = {p["role"] for p in rep["parts"]}
    assert {"qkv", "o_proj", "gate_up", "down", "attention", "lm_head"} <= roles
    assert "unattributed" not in roles
    assert [lay["layer"] for lay in rep["per_layer"]] == [0, 1]
    assert rep["per_layer"][0]["kernels"] == rep["per_layer"][1]["kernels"] > 0
    assert 0 < rep["kernel_sum_us"] and rep["step_us"] > 0
    assert rep["step_report"]["floors"]["bytes_us"] > 0
    json.dumps(rep)  # JSON-ready
