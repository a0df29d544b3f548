"""The plan cache: round trip, version invalidation, atomic writes, L2L_RETUNE and L2L_CACHE_DIR."""

from __future__ import annotations

import json

import pytest

import l2lightning.tune.cache as plan_cache
from l2lightning.tune.cache import PlanCache, current_versions, default_cache_path

V1 = {"torch": "2.11.0", "cupy": "14.2.0", "kernel": "abc", "l2lightning": "0.1.0"}
V2 = {**V1, "cupy": "14.3.0"}


def key(cache, **kw):
    args = dict(device="NVIDIA H200 (132 SMs, 60 MiB L2)", shape="Linear[2560x2560]:bfloat16:in4x2560")
    args.update(phase="forward", dtype="bfloat16", tuner="t1")
    args.update(kw)
    return cache.key(**args)


def test_round_trip_across_instances(tmp_path):
    path = tmp_path / "plans.json"
    cache = PlanCache(path, versions=V1, retune=False)
    cache.put(key(cache), {"chosen": True, "plan": {"kind": "hint", "blocks": 8}})
    again = PlanCache(path, versions=V1, retune=False)
    assert again.get(key(again)) == {"chosen": True, "plan": {"kind": "hint", "blocks": 8}}
    assert json.loads(path.read_text())["format"] == plan_cache.FORMAT_VERSION


def test_every_key_field_matters(tmp_path):
    cache = PlanCache(tmp_path / "plans.json", versions=V1, retune=False)
    base = key(cache)
    for change in (
        {"device": "NVIDIA H100"},
        {"shape": "Linear[1x1]"},
        {"phase": "backward"},
        {"dtype": "float16"},
        {"tuner": "t2"},
    ):
        assert key(cache, **change) != base, change


def test_a_version_change_invalidates_entries(tmp_path):
    path = tmp_path / "plans.json"
    old = PlanCache(path, versions=V1, retune=False)
    old.put(key(old), {"chosen": True})
    new = PlanCache(path, versions=V2, retune=False)
    assert new.get(key(new)) is None
    assert old.get(key(old)) == {"chosen": True}  # the old entry is only unreachable, not corrupted


def test_a_crash_mid_write_leaves_the_old_file_valid(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    cache = PlanCache(path, versions=V1, retune=False)
    cache.put(key(cache), {"chosen": True})
    before = path.read_text()

    def crashing_dump(data, f, **kwargs):
        f.write('{"format": 1, "entr')  # half a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cache.json, "dump", crashing_dump)
    with pytest.raises(KeyboardInterrupt):
        cache.put(key(cache, phase="backward"), {"chosen": False})
    assert path.read_text() == before
    assert PlanCache(path, versions=V1, retune=False).get(key(cache)) == {"chosen": True}
    assert not list(tmp_path.glob("*.tmp")), "the temporary file must be cleaned up"


def test_a_failed_replace_leaves_the_old_file_valid(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    cache = PlanCache(path, versions=V1, retune=False)
    cache.put(key(cache), {"chosen": True})

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(plan_cache.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.put(key(cache, phase="backward"), {"chosen": False})
    assert cache.get(key(cache)) == {"chosen": True}
    assert cache.get(key(cache, phase="backward")) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unserialisable_entry_is_rejected_before_touching_the_file(tmp_path):
    path = tmp_path / "plans.json"
    cache = PlanCache(path, versions=V1, retune=False)
    with pytest.raises(TypeError):
        cache.put(key(cache), {"bad": object()})
    assert not path.exists()


def test_a_corrupt_file_is_ignored_with_a_warning_then_rewritten(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    cache = PlanCache(path, versions=V1, retune=False)
    with pytest.warns(UserWarning, match="unreadable plan cache"):
        assert cache.get(key(cache)) is None
    cache.put(key(cache), {"chosen": False})
    assert cache.get(key(cache)) == {"chosen": False}


def test_retune_ignores_the_cache_but_still_writes(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    PlanCache(path, versions=V1, retune=False).put(key(PlanCache(path, versions=V1)), {"chosen": True})
    monkeypatch.setenv("L2L_RETUNE", "1")
    retuning = PlanCache(path, versions=V1)
    assert retuning.retune
    assert retuning.get(key(retuning)) is None
    retuning.put(key(retuning), {"chosen": False})
    monkeypatch.delenv("L2L_RETUNE")
    assert PlanCache(path, versions=V1).get(key(retuning)) == {"chosen": False}


def test_cache_dir_moves_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_CACHE_DIR", str(tmp_path / "elsewhere"))
    cache = PlanCache(versions=V1)
    assert cache.path == tmp_path / "elsewhere" / "plans.json"
    cache.put(key(cache), {"chosen": True})
    assert (tmp_path / "elsewhere" / "plans.json").is_file()


def test_default_path_is_under_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("L2L_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / ".cache" / "l2lightning" / "plans.json"


def test_default_path_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("L2L_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "xdg" / "l2lightning" / "plans.json"
    # The specification ignores a relative value; L2L_CACHE_DIR wins over both.
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_path() == tmp_path / "home" / ".cache" / "l2lightning" / "plans.json"
    monkeypatch.setenv("L2L_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_path() == tmp_path / "mine" / "plans.json"


def test_current_versions_name_torch_cupy_kernel_and_package():
    versions = current_versions()
    assert set(versions) == {"torch", "cupy", "kernel", "l2lightning"}
    assert len(versions["kernel"]) == 16  # the kernel source digest


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="`retune`"):
        PlanCache("x.json", retune="yes")
    with pytest.raises(TypeError, match="`versions`"):
        PlanCache("x.json", versions=["torch"])
    cache = PlanCache("x.json", versions=V1)
    with pytest.raises(ValueError, match="`shape`"):
        key(cache, shape="")
    with pytest.raises(TypeError, match="`entry`"):
        cache.put("k", ["not", "a", "mapping"])
