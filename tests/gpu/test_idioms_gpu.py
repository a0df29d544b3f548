"""GPU: L2GraphCallback on modules written the way users write them (issue 12).

Each idiom of ``tests/idiom_modules.py`` and ``tests/idiom_variants.py`` is fit for 60 steps plain, with the callback and with its
baseline (plain, switched to ``make_capturable``'s configuration at the callback's capture step) (``tests/idiom_harness.judge``). Every idiom must end bitwise equal
to its reference: the baseline when the callback captured, plain Lightning when it refused (and a
plain fit after the callback's fit must still equal the first one). Idioms expected to capture must
capture; a run that does not capture must name its reason.
"""

from __future__ import annotations

import pytest

from tests.idiom_harness import judge
from tests.idiom_modules import IDIOMS
from tests.idiom_variants import IDIOM_VARIANTS

pytestmark = pytest.mark.gpu

# What the refusal of each idiom expected to be refused must name.
REFUSAL_NAMES = {
    "sgd_onecycle_clip": "SGD's ['momentum'] change at every step: OneCycleLR",
    # two optimizers are captured (manual_gan_device_noise); the tutorial's noise is drawn on the host
    "manual_gan": "the step draws random numbers on the host, from torch's global CPU generator",
    "own_step_counter": "the step changes Python state (`self.updates`)",
    "adamw_onecycle_momentum": "AdamW's ['betas'] change at every step: OneCycleLR",
    "nan_guard_bad_batch": "`on_before_optimizer_step` may write: `optimizer.zero_grad()`",
    "grad_norm_own_clipping": "the module's `configure_gradient_clipping` changes the gradients",
}


@pytest.mark.parametrize("name", [*IDIOMS, *IDIOM_VARIANTS])
def test_idiom_captured_and_equal_or_refused_by_name_and_equal(name):
    idiom = IDIOMS[name] if name in IDIOMS else IDIOM_VARIANTS[name]
    result = judge(name, steps=60, accelerator="gpu")
    context = f"{name} (expect {idiom.expect}: {idiom.why}); reason: {result['reason']!r}"
    assert result["equal"] is True, f"{context}; {result['detail']}"
    if idiom.expect == "capture":
        assert result["captured"] is True, f"not captured: {context}"
    else:
        assert result["captured"] is False, f"captured, expected a refusal: {context}"
        assert REFUSAL_NAMES[name] in (result["reason"] or ""), f"refused without naming the cause: {context}"
