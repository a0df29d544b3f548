"""CPU tests of the harness's model-family cases (`l2lightning bench --families ...`).

Arguments and settings; every family composed from the packaged configs at the requested batch size,
built tiny, fed and stepped on the CPU; the floors of a family step; the rows through report's
comparisons, CSV, criteria and plots; the whole pipeline with stand-in runners; and a family's
Lightning variant really fitted on the CPU (the callback refuses without CUDA: the row must say so).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import get_class
from torch import nn

from l2lightning.app.models import FAMILIES
from l2lightning.tools import cli, report
from l2lightning.tools.bench import args as bench_args
from l2lightning.tools.bench import families as bench_families
from l2lightning.tools.bench import lightning_runners, step_floors, variants
from l2lightning.tools.bench import run as bench

pytestmark = [
    pytest.mark.filterwarnings("ignore:You are trying to .self.log"),
    pytest.mark.usefixtures("one_torch_thread"),
]
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"

TINY = bench.TINY_FAMILY_OVERRIDES


def _settings(**kw):
    base = {"models": [], "families": ["vit"], "batches": [4], "repeats": 1, "steps": 2, "lightning_skip": 2}
    return bench.BenchSettings(**{**base, **kw})


# ---------------------------------------------------------------------- arguments and settings
def test_families_option_parses_names_and_runs_no_mlp_case():
    parser = cli.build_parser()
    s = bench_args.settings_from_args(
        parser.parse_args(["bench", "--families", "vit,recommender", "--criteria", ""])
    )
    assert s.families == ["vit", "recommender"]
    assert s.models == []  # --families without --models: no MLP case
    assert s.batches == [4, 8, 16, 64]
    assert s.family_variants() == ["lightning_eager", "callback_off", "callback_auto"]
    # repeated names count once; spaces are tolerated
    s = bench_args.settings_from_args(parser.parse_args(["bench", "--families", "vit, vit,rl_policy"]))
    assert s.families == ["vit", "rl_policy"]


def test_families_all_is_every_family():
    args = cli.build_parser().parse_args(["bench", "--families", "all", "--batches", "4,8,16,64"])
    s = bench_args.settings_from_args(args)
    assert s.families == list(FAMILIES) and len(s.families) == 6
    assert s.batches == [4, 8, 16, 64] and s.models == []


def test_families_with_mlp_options_run_both():
    parser = cli.build_parser()
    s = bench_args.settings_from_args(parser.parse_args(["bench", "--families", "vit", "--models", "512x4"]))
    assert s.models == [(512, 4)] and s.families == ["vit"]
    s = bench_args.settings_from_args(parser.parse_args(["bench", "--families", "vit", "--widths", "768"]))
    assert s.models == [(768, 40)] and s.families == ["vit"]
    s = bench_args.settings_from_args(parser.parse_args(["bench"]))
    assert s.models == [(1536, 40)] and s.families == []


def test_unknown_family_is_an_argparse_error_listing_the_accepted_names(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--families", "vit,warp"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: l2lightning" in err and "argument --families" in err
    assert "unknown model families ['warp']" in err
    assert "choose from all, " + ", ".join(FAMILIES) in err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--families", ","])
    assert "unknown model families" in capsys.readouterr().err


def test_settings_validate_families():
    with pytest.raises(ValueError, match="unknown model families \\['warp'\\]; known: all, mlp_stack"):
        bench.BenchSettings(models=[], families=["warp"])
    with pytest.raises(ValueError, match="no model configuration.*--families"):
        bench.BenchSettings(models=[], families=[])


def test_help_describes_families(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--families NAME[,NAME...]" in out and "Lightning variants only" in out


# ---------------------------------------------------------------------- variants of a family case
def test_family_cases_run_lightning_variants_only():
    assert bench.FamilyCase("vit", 8).variants(_settings()) == list(variants.FAMILY_DEFAULT_VARIANTS)
    asked = _settings(variants=["eager", "graph", "callback_decoy", "lightning_eager", "compile_ro"])
    assert bench.FamilyCase("vit", 8).variants(asked) == ["lightning_eager", "callback_decoy"]
    with pytest.raises(ValueError, match="family cases run only the Lightning variants"):
        bench.make_runner("eager", bench.FamilyCase("vit", 8), _settings(), {})
    assert type(bench.make_runner("callback_off", bench.FamilyCase("vit", 8), _settings(), {})) is (
        bench.FamilyRunner
    )


def test_bench_cases_skip_non_lightning_variants_for_families_with_a_note():
    logs: list[str] = []
    settings = _settings(models=[(64, 2)], families=["vit", "rl_policy"], batches=[4, 8], chains=["step"])
    cases = list(bench.bench_cases(settings, logs.append))
    assert [c.label for c in cases] == [
        "d64x2 b4",
        "d64x2 b8",
        "vit b4",
        "vit b8",
        "rl_policy b4",
        "rl_policy b8",
    ]
    assert all(isinstance(c, bench.FamilyCase) for c in cases[2:])
    note = "\n".join(logs)
    assert "model families run lightning_eager, callback_off, callback_auto" in note
    for skipped in ("eager", "graph", "graph_prefetch", "compile_ro", "callback_decoy"):
        assert skipped in note.split("not for them:")[1]
    assert len(logs) == 1  # one note for the whole sweep, not one per case

    logs.clear()
    only_plain = _settings(families=["vit"], variants=["eager", "graph"])
    assert list(bench.bench_cases(only_plain, logs.append)) == []
    assert "names no Lightning variant" in logs[0]
    logs.clear()
    no_step = _settings(families=["vit"], chains=["forward"])
    assert list(bench.bench_cases(no_step, logs.append)) == []
    assert "--chains has no `step`" in logs[0]


# ---------------------------------------------------------------------- configs, modules, batches
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_case_composes_the_packaged_configs_at_the_batch_size(family):
    module_cls, data_cls = FAMILIES[family]
    cfg = bench.compose_family(family, 3)
    assert cfg.data.batch_size == 3
    assert get_class(cfg.model._target_) is module_cls and get_class(cfg.data._target_) is data_cls
    # the data module makes only the batches the harness draws, and no validation set
    sizes = [cfg.data[k] for k in ("train_batches", "steps_per_epoch") if k in cfg.data]
    assert sizes == [bench.FAMILY_BATCHES]
    assert cfg.data.get("val_batches", 0) == 0

    case = bench.FamilyCase(family, 3, overrides=tuple(TINY[family]))
    case.prepare()
    assert case.cfg.data.batch_size == 3 and case.facts is not None and case.facts.params > 0
    assert case.key() == {
        "family": family,
        "width": None,
        "depth": None,
        "batch": 3,
        "dtype": "float32",
        "chain": "step",
    }
    module, datamodule = bench.build_family(case.cfg)
    assert type(module) is module_cls and type(datamodule) is data_cls
    assert bench.model_facts(module) == case.facts
    batches = bench.family_batches(datamodule, "cpu")
    assert len(batches) == bench.FAMILY_BATCHES
    leaves = [t for t in torch.utils._pytree.tree_leaves(batches[0]) if isinstance(t, torch.Tensor)]
    assert leaves and all(t.shape[0] == 3 for t in leaves if t.ndim >= 1)

    # one eager step (what the kernel count profiles on the GPU) trains the module on the CPU
    before = [p.detach().clone() for p in module.parameters()]
    step = bench.eager_family_step(module, bench.module_optimizer(module), batches)
    losses = [float(step(i).detach()) for i in range(2)]
    assert all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_same_seed_same_weights_in_every_variant():
    cfg = bench.compose_family("vit", 2, TINY["vit"])
    a, _ = bench.build_family(cfg)
    torch.manual_seed(123)  # whatever ran before, the config's seed decides
    b, _ = bench.build_family(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_unknown_family_case_fails_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown model family 'warp'; known: mlp_stack, rl_policy"):
        bench.compose_family("warp", 4)


def test_module_optimizer_accepts_lightnings_return_forms():
    class Fake:
        def __init__(self, conf):
            self.conf = conf

        def configure_optimizers(self):
            return self.conf

    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    for conf in (opt, [opt], {"optimizer": opt, "lr_scheduler": None}, ([opt], []), [{"optimizer": opt}]):
        assert bench.module_optimizer(Fake(conf)) is opt
    with pytest.raises(TypeError, match="returned NoneType; expected an optimizer"):
        bench.module_optimizer(Fake(None))


# ---------------------------------------------------------------------- floors
def test_model_facts_and_step_floors_of_a_tiny_module():
    module = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))  # 12 + 3 + 3 + 3 = 21 elements
    module[0].to(torch.bfloat16)  # 15 bf16 elements (30 bytes) and 6 float32 ones (24 bytes)
    facts = bench.model_facts(module)
    assert facts.params == 21
    assert facts.param_bytes == {"bfloat16": 30, "float32": 24}
    assert facts.dtype == "bfloat16"  # most bytes: AdamW states counted at 2 bytes per element
    assert facts.layer_mib == pytest.approx(24 / 2**20)  # the 3x4 bf16 weight

    f = bench.family_step_floors(facts, kernel_count=40, copy_bw=1e9, empty_kernel_us=0.5)
    p, s = 30 + 24, 21 * 2
    # weights read in forward and backward, grads written, AdamW reads weights + grads, writes
    # weights, reads and writes both states: 6P + 4S
    assert f.bytes_by_phase == {"forward": p, "backward": 2 * p, "optimizer": 3 * p + 4 * s}
    assert f.bytes_moved == 6 * p + 4 * s
    assert f.bytes_us == pytest.approx((6 * p + 4 * s) / 1e9 * 1e6)
    assert f.launch_us == pytest.approx(20.0) and f.kernel_count == 40
    assert f.bound == "launch" and f.larger == pytest.approx(20.0)
    with pytest.raises(ValueError, match="has no parameters"):
        bench.model_facts(nn.ReLU())


def test_family_floors_use_the_kernel_count_of_one_eager_step(monkeypatch):
    case = bench.FamilyCase("vit", 2, overrides=tuple(TINY["vit"]))
    seen = []
    monkeypatch.setattr(step_floors, "_count_family_step_kernels", lambda c, device: seen.append(c) or 123)
    state = {"copy_bandwidth_bytes_per_s": 4e12, "empty_kernel_us": 1.5}
    f, kernels = bench.case_floors(case, state, _settings())
    assert seen == [case] and kernels == 123
    assert f.kernel_count == 123 and f.launch_us == pytest.approx(123 * 1.5)
    assert f.bytes_moved == 10 * case.facts.param_bytes["float32"]  # float32 states: S = P
    # without a measured bandwidth: no floors, but the kernel count stays
    assert bench.case_floors(case, {}, _settings()) == (None, 123)


# ---------------------------------------------------------------------- rows through report
def _family_case(family: str, batch: int) -> bench.FamilyCase:
    case = bench.FamilyCase(family, batch, overrides=tuple(TINY[family]))
    case.prepare()
    return case


class _StubRunner:
    def __init__(self, summaries):
        self.info = {"callback": summaries[-1]} if summaries else {}
        self.callback_summaries = summaries


def _rows(case, times: dict, captured: bool = True):
    settings = _settings()
    floors = bench.family_step_floors(case.facts, 500, 4e12, 1.0)
    rows = []
    for variant, us in times.items():
        summaries = (
            []
            if variant == "lightning_eager"
            else [{"captured": captured, "reason": None if captured else "hooks ['on_before_backward'] ..."}]
        )
        samples = [[us * (1 + 0.01 * i) for i in range(3)] for _ in range(6)]
        rows.append(
            bench.variant_row(
                case, variant, settings, False, samples, floors, 500, None, 0.1, _StubRunner(summaries)
            )
        )
    return rows


def test_family_rows_work_with_report_comparisons_csv_criteria_and_plots(tmp_path):
    vit = _rows(
        _family_case("vit", 8), {"lightning_eager": 9000.0, "callback_off": 3000.0, "callback_auto": 2900.0}
    )
    rec = _rows(
        _family_case("recommender", 8),
        {"lightning_eager": 6000.0, "callback_off": 6100.0, "callback_auto": 6150.0},
        captured=False,
    )
    report.add_comparisons(vit + rec)  # as run_bench does at the end, over all rows together
    auto = {r["family"]: r for r in vit + rec if r["variant"] == "callback_auto"}
    assert auto["vit"]["speedup_vs_lightning_eager"] == pytest.approx(9000 / 2900, rel=1e-2)
    assert auto["vit"]["gain_vs_no_prefetch"] == pytest.approx(3000 / 2900 - 1, rel=1e-2)
    assert auto["recommender"]["speedup_vs_lightning_eager"] == pytest.approx(6000 / 6150, rel=1e-2)
    assert auto["vit"]["ratio_to_floor"] > 1 and auto["vit"]["floor_us"] > 0
    # two families at one batch are two groups (the family is part of the key)
    assert {tuple(r.get(k) for k in report.GROUP_KEYS) for r in vit + rec} == {
        ("vit", None, None, 8, "float32", "step"),
        ("recommender", None, None, 8, "float32", "step"),
    }

    row = auto["recommender"]
    assert row["config"] == "recommender b8" and row["family"] == "recommender" and row["batch"] == 8
    assert row["captured"] is False and row["capture_reason"].startswith("hooks")
    assert auto["vit"]["captured"] is True and auto["vit"]["capture_reason"] is None
    eager = next(r for r in vit if r["variant"] == "lightning_eager")
    assert eager["captured"] is None
    assert row["params"] == _family_case("recommender", 8).facts.params
    assert row["model_target"] == "l2lightning.app.models.Recommender" and row["kernel_count"] == 500
    assert row["width"] is None and row["depth"] is None and row["layer_mib"] > 0

    rows = vit + rec
    path = report.write_csv(tmp_path / "r.csv", rows, bench.CSV_COLUMNS + bench.FAMILY_CSV_COLUMNS)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("config,chain,variant") and lines[0].endswith(
        ",".join(bench.FAMILY_CSV_COLUMNS)
    )
    assert len(lines) == 1 + len(rows) and lines[1].startswith("vit b8,step,lightning_eager")
    assert ",recommender," in lines[-1] and ",False," in lines[-1]

    criteria, _ = report.load_criteria(ROOT / "benchmarks" / "criteria.yaml")
    results = {r.criterion.id: r for r in report.evaluate(criteria, rows)}
    # scoped on d1536x40: family rows are out of scope
    assert results["callback-4x-lightning-eager-small-batch"].status == "no data"
    # prefetch never costs more than 1%: recommender's callback_auto is 0.8% slower, within it
    assert results["prefetch-never-worse-than-minus-1pct"].status == "passed"
    assert len(results["prefetch-never-worse-than-minus-1pct"].observations) == 2

    doc = {"results": rows, "environment": {"gpu": {"l2_bytes": 60 << 20}}}
    plots = bench.write_plots(doc, tmp_path / "out", lambda m: pytest.fail(m))
    names = {p.relative_to(tmp_path / "out").as_posix() for p in plots}
    assert {"families/vit/speedup.png", "families/recommender/time_vs_floors.png"} <= names
    assert not (tmp_path / "out" / "speedup.png").exists()  # no MLP case, no MLP plot


def test_capture_fields_over_fits():
    ok = {"captured": True, "reason": None, "fallback_steps": 0}
    refused = {"captured": False, "reason": "no CUDA (torch built without CUDA)", "fallback_steps": 0}
    assert bench.capture_fields("callback_off", [ok, ok]) == {
        "captured": True,
        "capture_reason": None,
        "fallback_steps": 0,
    }
    assert bench.capture_fields("callback_off", [refused]) == {
        "captured": False,
        "capture_reason": "no CUDA (torch built without CUDA)",
        "fallback_steps": 0,
    }
    mixed = bench.capture_fields("callback_auto", [ok, refused, {**ok, "fallback_steps": 3}])
    assert mixed["captured"] is False and mixed["fallback_steps"] == 3
    assert mixed["capture_reason"] == "not captured in 1 of 3 fits: no CUDA (torch built without CUDA)"
    assert bench.capture_fields("callback_auto", [{"summary_error": "KeyError: x"}])["capture_reason"] == (
        "KeyError: x"
    )
    assert bench.capture_fields("lightning_eager", [ok])["captured"] is None
    assert bench.capture_fields("callback_off", [])["captured"] is None  # never fitted


# ---------------------------------------------------------------------- the pipeline with stand-ins
def _recorded_h200_state() -> dict:
    from l2lightning.tools import doctor

    measured = json.loads((FIXTURES / "h200_measured.json").read_text())
    return doctor.state_from_nvidia_smi(
        (FIXTURES / "nvidia_smi_h200_idle.csv").read_text(),
        (FIXTURES / "nvidia_smi_h200_load.csv").read_text(),
        measured,
    )


FAKE_US = {
    "lightning_eager": 12000.0,
    "callback_off": 4000.0,
    "callback_auto": 3950.0,
    "callback_decoy": 4010.0,
}


@pytest.fixture
def fake_family_gpu(monkeypatch, tmp_path):
    """run_bench on CPU: a recorded H200 doctor state, stand-in runners and floors; real configs and rows."""
    from l2lightning.tools import doctor

    calls: list[tuple[str, str]] = []

    class FakeRunner(bench.Runner):
        def setup(self) -> None:
            self.case.prepare()
            self.callback_summaries = []

        def run(self, steps: int) -> list[float]:
            calls.append((self.case.label, self.variant))
            if self.variant != "lightning_eager":
                captured = self.case.family != "conv_stack"
                self.callback_summaries.append(
                    {"captured": captured, "reason": None if captured else "stand-in refusal"}
                )
            # conv_stack twice as fast: a row compared with another family's baseline would show it
            scale = 0.5 if self.case.family == "conv_stack" else 1.0
            return [FAKE_US[self.variant] * scale * (1 + 0.001 * i) for i in range(steps)]

    def fake_floors(case, gpu_state, settings):
        assert isinstance(case, bench.FamilyCase), "no MLP case may run with only --families"
        f = bench.family_step_floors(case.facts, 700, gpu_state["copy_bandwidth_bytes_per_s"], 1.0)
        return f, 700

    real_compose = bench.compose_family

    def compose(family, batch, overrides=()):
        if family == "text_encoder":
            raise RuntimeError("stand-in: this config does not compose")
        return real_compose(family, batch, [*overrides, *TINY[family]])

    state = _recorded_h200_state()
    monkeypatch.setattr(doctor, "collect", lambda *a, **k: state)
    monkeypatch.setattr(bench, "make_runner", lambda v, c, s, shared: FakeRunner(v, c, s, shared))
    monkeypatch.setattr(bench, "case_floors", fake_floors)
    monkeypatch.setattr(bench_families, "compose_family", compose)
    return {"calls": calls, "out": tmp_path / "results"}


def test_family_sweep_pipeline(fake_family_gpu, capsys):
    out = fake_family_gpu["out"]
    criteria = ROOT / "benchmarks" / "criteria.yaml"
    argv = ["bench", "--families", "vit,text_encoder,conv_stack", "--batches", "4,8"]
    code = cli.main([*argv, "--repeats", "3", "--steps", "4", "--out", str(out), "--criteria", str(criteria)])
    printed = capsys.readouterr().out
    assert code == 0, printed

    # only Lightning variants ran, each case interleaved over the repeats; no MLP case
    calls = fake_family_gpu["calls"]
    assert {v for _, v in calls} == {"lightning_eager", "callback_off", "callback_auto"}
    assert {c for c, _ in calls} == {"vit b4", "vit b8", "conv_stack b4", "conv_stack b8"}
    assert len(calls) == 4 * 3 * 3
    assert "model families run lightning_eager, callback_off, callback_auto; not for them: " in printed
    assert "vit b8 [step]: lightning_eager, callback_off, callback_auto" in printed

    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] is True and doc["settings"]["families"] == ["vit", "text_encoder", "conv_stack"]
    rows = doc["results"]
    assert len(rows) == 3 * 2 * 3 and all(r["family"] for r in rows)
    # the case that could not be built: error rows, and the sweep went on
    broken = [r for r in rows if r["family"] == "text_encoder"]
    assert len(broken) == 6 and all(r["median_us"] is None for r in broken)
    assert broken[0]["error"] == "case: RuntimeError: stand-in: this config does not compose"
    assert "ERROR case: RuntimeError: stand-in: this config does not compose" in printed

    auto = next(r for r in rows if r["config"] == "vit b8" and r["variant"] == "callback_auto")
    assert auto["speedup_vs_lightning_eager"] == pytest.approx(12000 / 3950, rel=1e-2)
    assert auto["gain_vs_no_prefetch"] == pytest.approx(4000 / 3950 - 1, rel=1e-2)
    assert auto["captured"] is True and auto["kernel_count"] == 700 and auto["ratio_to_floor"] > 1
    assert auto["n"] == 3 and auto["ci_lo_us"] <= auto["median_us"] <= auto["ci_hi_us"]
    conv_auto = next(r for r in rows if r["config"] == "conv_stack b8" and r["variant"] == "callback_auto")
    assert conv_auto["median_us"] == pytest.approx(auto["median_us"] / 2)
    assert conv_auto["speedup_vs_lightning_eager"] == pytest.approx(auto["speedup_vs_lightning_eager"])
    conv = next(r for r in rows if r["config"] == "conv_stack b4" and r["variant"] == "callback_off")
    assert conv["captured"] is False and conv["capture_reason"] == "stand-in refusal"
    assert "NOT captured: stand-in refusal" in printed

    results = {c["id"]: c for c in doc["criteria_results"]}
    assert results["prefetch-never-worse-than-minus-1pct"]["status"] == "failed"  # errored rows count
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.endswith("family,params,captured,capture_reason,fallback_steps")
    assert (out / "families" / "vit" / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "families" / "conv_stack" / "time_vs_floors.png").is_file()


# ---------------------------------------------------------------------- a real fit on the CPU
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runner_fits_through_lightning_on_cpu(family, monkeypatch):
    """FamilyRunner's fit path for real (Trainer, step timer, callback), with the CPU in place of CUDA.

    On the CPU the step timer reads the host clock. Without CUDA the callback refuses to capture:
    the row must say so, not fail.
    """

    cpu_trainer = functools.partial(lightning_runners.lightning_trainer, accelerator="cpu")
    monkeypatch.setattr(lightning_runners, "lightning_trainer", cpu_trainer)
    settings = _settings(families=[family], steps=2, lightning_skip=2)
    case = bench.FamilyCase(family, 3, overrides=tuple(TINY[family]))
    case.prepare()
    variants = ["lightning_eager", "callback_off"] if family == "vit" else ["callback_off"]
    for variant in variants:
        runner = bench.make_runner(variant, case, settings, {})
        runner.device = torch.device("cpu")
        runner.setup()
        try:
            times = runner.run(settings.steps)
        finally:
            runner.close()
        assert len(times) == 2 and all(t > 0 for t in times)
        row = bench.variant_row(case, variant, settings, False, [times], None, None, None, 0.0, runner)
        assert row["median_us"] > 0 and row["model_target"] == case.cfg.model._target_
        if variant == "lightning_eager":
            assert row["captured"] is None
        else:
            assert row["captured"] is False and row["capture_reason"].startswith("no CUDA")
