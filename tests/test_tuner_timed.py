"""The tuner's pick of a fast device, measured within a budget (tests/test_tuner.py has the
rest): whether the device's step is measured early and picked depends on the seconds
measured, which another test beside it would change, so it runs alone
(tests/two_at_once.py), in a module of its own, so that the tuner's other tests run beside
other tests before any test alone begins."""

from dataclasses import replace

import pytest

from hybriddl.tuning import tuner
from test_tuner import TINY, fake_device  # noqa: F401  (fake_device: a fixture)


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
