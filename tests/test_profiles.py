import json
from pathlib import Path

import pytest

from hybriddl.tuning.tuner import tune_settings
from hybriddl.tuning import profiles
from hybriddl.errors import UsageError
from hybriddl.strategies import StrategySpec
from hybriddl.tuning.profiles import (DROPPED, MEASURED, SCHEMA_VERSION, CandidateResult, Profile,
                               ProfileError, Settings, find_profile,
                               fingerprint_changes, load_profile, profile_path, save_profile)

SETTINGS = Settings(usecase="ComplexSmall", model="vgg16", image_size=32, batch_size=4)
FINGERPRINT = {"cpu_model": "Test CPU", "cores_usable": 2, "ram_gib": 8.0, "gpus": [],
               "torch": "2.0", "allocator": "glibc"}
SEQUENTIAL = StrategySpec("sequential")


def a_profile(pick=SEQUENTIAL, settings=SETTINGS, host="node1", fp=FINGERPRINT) -> Profile:
    candidates = [
        CandidateResult(SEQUENTIAL, MEASURED, seconds_per_step=2.0, timed_steps=5,
                        images_per_second=2.0, speedup=1.0, peak_rss_bytes=1000),
        CandidateResult(StrategySpec("threads", workers=2), DROPPED,
                        note="a step took 9.00 s: a timed one would overrun its 3.0 s share of the budget"),
    ]
    if pick != SEQUENTIAL:
        candidates.append(CandidateResult(pick, MEASURED, seconds_per_step=1.0, timed_steps=5,
                                          images_per_second=4.0, speedup=2.0, peak_rss_bytes=2000))
    return Profile(host=host, fingerprint=dict(fp), settings=settings, candidates=candidates,
                   pick=pick, measurement={"warmup_steps": 1, "timed_steps": 5})


def lookup(directory, settings=SETTINGS, host="node1", fp=FINGERPRINT):
    return find_profile(directory, settings, host=host, current_fingerprint=dict(fp))


def test_profile_round_trips_through_its_file(tmp_path):
    pick = StrategySpec("pipeline", micro_batches=4, devices=("cuda:0", "cuda:1"))
    original = a_profile(pick=pick)
    path = save_profile(original, tmp_path / "new" / "node1-ComplexSmall.json")
    assert load_profile(path) == original
    record = json.loads(path.read_text())
    assert record["schema_version"] == SCHEMA_VERSION
    assert record["pick"] == {"name": "pipeline", "workers": None, "micro_batches": 4,
                              "devices": ["cuda:0", "cuda:1"]}
    assert [c["status"] for c in record["candidates"]] == ["measured", "dropped", "measured"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["node1-ComplexSmall.json"]


def test_profile_path_is_host_usecase_model_batch_and_size(tmp_path):
    settings = Settings("SimpleBig", "alexnet", image_size=64, batch_size=32)
    assert (profile_path(tmp_path, settings, host="gpu7")
            == tmp_path / "gpu7-SimpleBig-alexnet-b32-64px.json")
    others = [Settings("SimpleBig", "vgg16", 64, 32), Settings("SimpleBig", "alexnet", 64, 16),
              Settings("SimpleBig", "alexnet", 224, 32), Settings("ComplexSmall", "alexnet", 64, 32)]
    paths = {profile_path(tmp_path, s, host="gpu7") for s in [settings, *others]}
    assert len(paths) == 5  # one file per setting: a tune never overwrites another's


def test_profiles_at_two_settings_live_side_by_side(tmp_path):
    other = Settings("ComplexSmall", "vgg16", image_size=64, batch_size=4)
    save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    save_profile(a_profile(settings=other), profile_path(tmp_path, other, host="node1"))
    assert lookup(tmp_path).usable and lookup(tmp_path, settings=other).usable
    assert lookup(tmp_path, settings=other).profile.settings == other


def test_profile_under_the_old_per_usecase_name_is_still_read(tmp_path):
    old = profiles.legacy_profile_path(tmp_path, "ComplexSmall", host="node1")
    assert old == tmp_path / "node1-ComplexSmall.json"
    record = a_profile().to_dict()
    record["schema_version"] = 1  # written before rounds: no round_seconds, no spread
    for candidate in record["candidates"]:
        for key in ("rounds", "round_seconds", "spread_seconds"):
            candidate.pop(key)
    old.write_text(json.dumps(record))
    found = lookup(tmp_path)
    assert found.usable and found.path == old and found.profile.pick == SEQUENTIAL
    assert found.profile.candidates[0].spread_seconds is None
    # At other settings the old file is not used, and a new tune goes to the new name.
    other = Settings("ComplexSmall", "vgg16", image_size=64, batch_size=4)
    missed = lookup(tmp_path, settings=other)
    assert not missed.usable and "was measured at" in missed.problem
    assert missed.path == profile_path(tmp_path, other, host="node1") != old


REPO_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def test_committed_profiles_load_under_their_per_setting_names():
    committed = sorted(REPO_PROFILES.glob("*.json"))
    assert committed, "the repository ships measured profiles"
    for path in committed:
        profile = load_profile(path)
        assert path == profile_path(REPO_PROFILES, profile.settings, host=profile.host)


def test_the_readme_main_job_at_64_px_never_rewrites_a_committed_profile():
    # hybriddl train --usecase ComplexSmall --image-size 64 --epochs 5: one host, whole batch.
    main_job = tune_settings("ComplexSmall", image_size=64)
    committed_224 = tune_settings("ComplexSmall")
    for host in ["vm", profiles.this_host()]:
        path = profile_path(REPO_PROFILES, main_job, host=host)
        assert path != profile_path(REPO_PROFILES, committed_224, host=host)
        assert path not in set(REPO_PROFILES.glob("*.json"))


def test_rounds_and_spread_round_trip(tmp_path):
    original = a_profile()
    original.candidates[0].round_seconds = [2.1, 1.9, 2.0]
    original.candidates[0].spread_seconds = (1.9, 2.1)
    path = save_profile(original, profile_path(tmp_path, SETTINGS, host="node1"))
    record = json.loads(path.read_text())["candidates"][0]
    assert (record["rounds"], record["round_seconds"], record["spread_seconds"]) == (
        3, [2.1, 1.9, 2.0], [1.9, 2.1])
    assert load_profile(path) == original
    assert original.candidates[0].relative_noise == pytest.approx(0.05)


def test_profile_dir_comes_from_flag_then_environment_then_default(monkeypatch):
    monkeypatch.setenv(profiles.DIR_ENV, "/from/env")
    assert str(profiles.profile_dir("given")) == "given"
    assert str(profiles.profile_dir()) == "/from/env"
    monkeypatch.delenv(profiles.DIR_ENV)
    assert str(profiles.profile_dir()) == "profiles"


def test_strategy_choice_gives_the_strategy_options():
    choice = StrategySpec("pipeline", micro_batches=8, devices=("cuda:0", "cuda:0"))
    options = choice.options()
    assert (options.micro_batches, options.devices, options.workers) == (8, ("cuda:0", "cuda:0"), None)
    assert choice.label == "pipeline cuda:0,cuda:0 M=8"
    assert StrategySpec("threads", workers=3).options(oversubscribe=True).oversubscribe
    assert StrategySpec.from_dict(choice.to_dict()) == choice


def test_matching_profile_is_usable(tmp_path):
    save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    found = lookup(tmp_path)
    assert found.usable and found.problem is None
    assert found.profile.pick == SEQUENTIAL


def test_missing_profile_says_where_it_looked(tmp_path):
    found = lookup(tmp_path)
    assert not found.usable
    assert found.problem == f"no profile at {tmp_path / 'node1-ComplexSmall-vgg16-b4-32px.json'}"


@pytest.mark.parametrize("other", [
    Settings("ComplexSmall", "vgg16", image_size=64, batch_size=4),
    Settings("ComplexSmall", "vgg16", image_size=32, batch_size=8),
    Settings("ComplexSmall", "resnet18", image_size=32, batch_size=4),
])
def test_profile_at_other_settings_does_not_match(tmp_path, other):
    save_profile(a_profile(settings=other), profile_path(tmp_path, SETTINGS, host="node1"))
    found = lookup(tmp_path)
    assert not found.usable
    assert f"was measured at {other.describe()}, not at {SETTINGS.describe()}" in found.problem


def test_profile_of_another_host_does_not_match(tmp_path):
    save_profile(a_profile(host="node2"), profile_path(tmp_path, SETTINGS, host="node1"))
    assert "measured on host 'node2'" in lookup(tmp_path).problem


def test_changed_fingerprint_makes_the_profile_stale(tmp_path):
    save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    found = lookup(tmp_path, fp={**FINGERPRINT, "cores_usable": 4, "gpus": ["NVIDIA H100"]})
    assert not found.usable
    assert "is stale" in found.problem
    assert "cores_usable 2 -> 4" in found.problem and "gpus [] -> ['NVIDIA H100']" in found.problem


def test_fingerprint_changes_lists_only_what_differs():
    assert fingerprint_changes(FINGERPRINT, dict(FINGERPRINT)) == []
    assert fingerprint_changes(FINGERPRINT, {**FINGERPRINT, "torch": "2.1"}) == ["torch '2.0' -> '2.1'"]


def test_this_hosts_fingerprint_has_the_documented_fields():
    fp = profiles.fingerprint()
    assert set(fp) == {"cpu_model", "cores_usable", "ram_gib", "gpus", "torch", "allocator"}
    assert fp["cores_usable"] >= 1 and isinstance(fp["gpus"], list)


def test_truncated_profile_is_a_clear_problem_not_a_crash(tmp_path):
    path = save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    path.write_text(path.read_text()[:120])
    with pytest.raises(ProfileError, match="is not valid JSON .*truncated.*hybriddl tune"):
        load_profile(path)
    found = lookup(tmp_path)
    assert not found.usable and "is not valid JSON" in found.problem


def test_wrong_schema_version_is_a_clear_problem(tmp_path):
    path = save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    record = json.loads(path.read_text())
    record["schema_version"] = 99
    path.write_text(json.dumps(record))
    with pytest.raises(UsageError, match="schema version 99, this hybriddl reads versions 1, 2"):
        load_profile(path)
    assert "schema version 99" in lookup(tmp_path).problem


@pytest.mark.parametrize("damage", [
    lambda r: r.pop("candidates"),
    lambda r: r["settings"].pop("batch_size"),
    lambda r: r["candidates"][0].update(status="maybe"),
    lambda r: r["candidates"][0].update(seconds_per_step=None),
    lambda r: r.update(pick={"name": "threads", "workers": 2}),  # dropped, so not a pick
    lambda r: r["candidates"][0].update(timed_steps=float("inf")),  # Infinity, hand-edited
])
def test_damaged_profile_is_a_clear_problem(tmp_path, damage):
    path = save_profile(a_profile(), profile_path(tmp_path, SETTINGS, host="node1"))
    record = json.loads(path.read_text())
    damage(record)
    path.write_text(json.dumps(record))  # Infinity as Python's json writes and reads it
    with pytest.raises(ProfileError, match="hybriddl tune"):
        load_profile(path)
    assert not lookup(tmp_path).usable


def test_profile_that_is_not_an_object_is_a_clear_problem(tmp_path):
    path = profile_path(tmp_path, SETTINGS, host="node1")
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="is not a profile .a JSON object is expected"):
        load_profile(path)


@pytest.mark.parametrize("pick", [
    StrategySpec("warp-drive", workers=2),
    StrategySpec("gpu", devices=("cuda:99",)),
])
def test_pick_this_host_cannot_run_makes_the_profile_unusable(tmp_path, pick):
    save_profile(a_profile(pick=pick), profile_path(tmp_path, SETTINGS, host="node1"))
    found = lookup(tmp_path)
    assert not found.usable
    assert f"picks {pick.label}, which this host cannot run" in found.problem


def test_profiled_throughput_is_the_picks_images_per_second(tmp_path):
    host_fp = profiles.fingerprint()
    save_profile(a_profile(host=profiles.this_host(), fp=host_fp),
                 profile_path(tmp_path, SETTINGS))
    assert profiles.profiled_throughput(SETTINGS, tmp_path) == 2.0
    other = Settings("ComplexSmall", "vgg16", image_size=32, batch_size=5)
    assert profiles.profiled_throughput(other, tmp_path) is None


def test_a_profile_folder_that_cannot_be_searched_is_a_problem_not_a_traceback(tmp_path,
                                                                                monkeypatch):
    """As a user without search permission on it (root searches every folder)."""
    import pathlib

    real = pathlib.Path.exists

    def exists(path, *args, **kwargs):
        if tmp_path in path.parents:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "exists", exists)
    found = lookup(tmp_path)
    assert not found.usable and found.problem == f"cannot look in {tmp_path} (Permission denied)"


def test_tune_into_a_folder_that_cannot_be_searched_is_one_line_exit_2(tmp_path, monkeypatch,
                                                                       capsys):
    import pathlib

    from hybriddl.cli import main

    locked = tmp_path / "locked"
    real = pathlib.Path.is_dir

    def is_dir(path):
        if locked in (path, *path.parents):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(pathlib.Path, "is_dir", is_dir)
    assert main(["tune", "--budget", "3", "--output", str(locked / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot look there (Permission denied)" in err and len(err.strip().splitlines()) == 1
