"""The tuner's measurements of real steps within a budget (tests/test_tuner.py has the
rest): another test beside one would change what it measures, so these run alone
(tests/two_at_once.py), in a module of their own, so that the tuner's other tests run beside
other tests before any test alone begins."""

import json
from dataclasses import replace

import pytest

from hybriddl.tuning import profiles, tuner
from hybriddl.tuning.profiles import Profile, Settings, load_profile
from hybriddl.tuning.tuner import BASELINE
from test_tuner import TINY, fake_device, tiny_images  # noqa: F401  (fake_device: a fixture)

@pytest.mark.alone  # measures steps within a budget: another test beside it would change them
@pytest.mark.slow
def test_tune_host_measures_real_steps_into_a_profile():
    profile = tuner.tune_host(TINY, tiny_images(), budget=600, steps=1, rounds=2, second_look=1)
    assert profile.settings == TINY and profile.host == profiles.this_host()
    assert (profile.measurement["rounds"], profile.measurement["second_look_rounds"]) == (2, 1)
    assert profile.fingerprint == profiles.fingerprint()
    assert profile.candidates[0].choice == BASELINE
    measured = [c for c in profile.candidates if c.measured]
    assert all(len(c.round_seconds) in (2, 3) and c.timed_steps == len(c.round_seconds)
               and c.peak_rss_bytes > 0 for c in measured)
    # The second look: the two fastest after two rounds, and any whose fastest visit is
    # within the span of the fastest.
    looked = [c for c in measured if len(c.round_seconds) == 3]
    assert min(2, len(measured)) <= len(looked) <= tuner.SECOND_LOOK_MOST
    first_two = {c.choice: c.round_seconds[:2] for c in measured}
    assert {c.choice for c in looked} == {
        measured[i].choice for i in tuner.second_look_group(dict(enumerate(first_two.values())))}
    assert profile.pick_result.seconds_per_step == min(c.seconds_per_step for c in measured)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


@pytest.mark.alone  # measures steps within a budget: another test beside it would change them
@pytest.mark.slow
def test_tune_command_writes_a_valid_profile_and_shows_the_table(cli, tmp_path):
    output = tmp_path / "out" / "here.json"
    # A small model: every candidate is measured all the same, in a fraction of VGG16's time.
    done = cli("tune", "--usecase", "ComplexSmall", "--model", "squeezenet1_1", "--image-size",
               "32", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--second-look", "0",
               "--output", str(output),
               COLUMNS="200")  # the whole table on one line per candidate
    assert done.returncode == 0, done.stderr
    profile = load_profile(output)
    assert profile.settings == Settings("ComplexSmall", "squeezenet1_1", 32, 4)
    # Rounds and the second look are measured in test_tune_host_measures_real_steps_...;
    # here one round keeps the CLI's run short, and the flags must reach the tuner.
    assert (profile.measurement["timed_steps"], profile.measurement["rounds"],
            profile.measurement["second_look_rounds"]) == (1, 1, 0)
    assert profile.candidates[0].choice == BASELINE and profile.candidates[0].measured
    assert "pick" in done.stdout and f"profile written to {output}" in " ".join(done.stdout.split())
    assert profile.pick.label in done.stdout
    assert "median s/step" in done.stdout and "spread" in done.stdout
    low, high = profile.pick_result.spread_seconds
    assert f"{low:.3f}-{high:.3f}" in done.stdout


@pytest.mark.alone  # measures steps within a budget: another test beside it would change them
@pytest.mark.slow
def test_tune_with_accumulate_measures_every_candidate_with_it(cli, tmp_path):
    """Also what a tune without --output writes: one file, in the profile directory
    (HYBRIDDL_PROFILES), under profile_path's name (its parts: tests/test_profiles.py)."""
    done = cli("tune", "--usecase", "ComplexSmall", "--model", "squeezenet1_1", "--image-size",
               "32", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--second-look", "0",
               "--accumulate", "2", HYBRIDDL_PROFILES=str(tmp_path))
    assert done.returncode == 0, done.stderr
    # Its own file: a tune with accumulation never replaces the one without.
    [path] = list(tmp_path.iterdir())
    assert path.name == f"{profiles.this_host()}-ComplexSmall-squeezenet1_1-b4-32px-acc2.json"
    profile = load_profile(path)
    assert profile.settings == Settings("ComplexSmall", "squeezenet1_1", 32, 4, accumulate=2)
    assert {c.choice.accumulate for c in profile.candidates} == {2}
    assert profile.candidates[0].choice.name == "sequential"
    assert profile.candidates[0].speedup == 1.0  # still the baseline of the speedups
    assert "accumulate=2" in profile.pick.label


@pytest.mark.alone  # measures steps within a budget: another test beside it would change them
@pytest.mark.slow
def test_tune_host_measures_a_registered_fast_device_early_and_picks_it(fake_device):
    # A model of many operations and few parameters: the device's step is an optimizer update
    # (about 1 ms for squeezenet's 0.7M parameters), the CPU's about 10x longer, so "3x
    # faster" holds on a loaded runner. resnet18 at 32 px measured 3.0-3.7x (its 11M
    # parameters make the update most of either step), and CI once measured 3 CPU variations.
    settings = replace(TINY, precision="auto", model="squeezenet1_1", image_size=64, batch_size=4)
    profile = tuner.tune_host(settings, tuner.embedded_images(settings), budget=120,
                              steps=1, rounds=2, second_look=1)
    by_name = {}
    for c in profile.candidates:
        by_name.setdefault(c.choice.name, []).append(c)
    assert profile.pick.name == "fake-device"  # in either memory format: both take no time
    assert by_name["fake-device"][0].measured and by_name["sequential"][0].measured
    # The CPU variations other than the baseline and the best guess were outrun.
    cpu = [c for c in profile.candidates if c.choice.name not in ("fake-device", "sequential")]
    assert sum(c.measured for c in cpu) == 1
    assert all("fake-device step measured" in c.note for c in cpu if not c.measured)
    # --precision auto: the device's bf16 variant measured beside its float32 ones, and the
    # log's line says what it gained; the slow baseline was measured once.
    assert tuner.bf16_gain(profile).startswith("bf16 autocast measured")
    assert "float32's speed on fake-device" in tuner.bf16_gain(profile)
    assert len(by_name["sequential"][0].round_seconds) == 1
