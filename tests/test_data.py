"""Data sources, the train/validation split, and the deterministic batch stream."""

import threading

import numpy as np
import pytest
import torch
from sample_data import (CIFAR_CLASSES, CIFAR_FOLDER, write_cifar10, write_image,
                         write_imagefolder)

from hybriddl import data
from hybriddl.data.loading import load_data
from hybriddl.errors import UsageError
from hybriddl.usecases import RGB_MEAN, RGB_STD


def pixel(image: torch.Tensor, y: int, x: int) -> list[int]:
    return image[:, y, x].tolist()


# --------------------------------------------------------------------------- embedded data

@pytest.mark.parametrize("variant", ["small", "big"])
def test_synthetic_variant_has_the_declared_sizes_and_balanced_classes(variant):
    per_class_train, per_class_val, size = data.SYNTHETIC_VARIANTS[variant]
    split = load_data("synthetic", variant=variant, image_size=32)
    assert split.classes == ["fire", "smoke", "clear"]
    assert split.train.images.shape == (3 * per_class_train, 3, size, size)
    assert split.val.images.shape == (3 * per_class_val, 3, size, size)
    assert split.train.images.dtype == torch.uint8
    assert torch.bincount(split.train.labels).tolist() == [per_class_train] * 3
    assert torch.bincount(split.val.labels).tolist() == [per_class_val] * 3


def test_big_variant_is_bigger_than_small():
    assert data.SYNTHETIC_VARIANTS["big"][0] > data.SYNTHETIC_VARIANTS["small"][0]


def test_synthetic_images_are_the_same_bytes_every_time():
    first = data.synthetic_split("small")
    second = data.synthetic_split("small")
    assert torch.equal(first.train.images, second.train.images)
    assert torch.equal(first.val.images, second.val.images)
    assert torch.equal(first.train.labels, second.train.labels)


def test_synthetic_images_differ_from_one_index_to_the_next():
    a = data.render_synthetic(0, 3, 32)
    b = data.render_synthetic(0, 6, 32)
    assert a.shape == (3, 32, 32) and a.dtype == np.uint8
    assert np.array_equal(a, data.render_synthetic(0, 3, 32))
    assert not np.array_equal(a, b)


def test_synthetic_validation_images_are_not_training_images():
    split = data.synthetic_split("small")
    train = {bytes(image.numpy()) for image in split.train.images}
    assert not any(bytes(image.numpy()) in train for image in split.val.images)


def test_classes_option_is_refused_for_synthetic_data():
    with pytest.raises(UsageError, match="--classes"):
        load_data("synthetic", variant="small", image_size=32, classes=2)


def test_unknown_synthetic_variant_is_a_usage_error():
    with pytest.raises(UsageError, match="variant 'huge'"):
        data.synthetic_split("huge")


def test_data_progress_is_reported_up_to_the_total():
    calls = []
    data.synthetic_split("small", progress=lambda done, total: calls.append((done, total)))
    total = 3 * sum(data.SYNTHETIC_VARIANTS["small"][:2])
    assert calls[-1] == (total, total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


# --------------------------------------------------------------------------- ImageFolder

def test_imagefolder_scales_and_crops_every_file_to_the_image_size(tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=5)
    split = load_data(str(root), variant="small", image_size=16, val_fraction=0.2)
    assert split.classes == ["fire", "smoke"]
    assert split.source == f"imagefolder:{root}"
    assert len(split.train) == 8 and len(split.val) == 2
    assert split.train.images.shape == (8, 3, 16, 16)
    assert split.val.images.shape == (2, 3, 16, 16)
    assert torch.bincount(split.val.labels).tolist() == [1, 1]
    for images in (split.train, split.val):
        for image, label in zip(images.images, images.labels):
            colour = [(230, 80, 10), (150, 150, 150)][int(label)]
            # Plain colours survive scaling exactly in PNG, within JPEG's loss otherwise.
            assert (image.int() - torch.tensor(colour).view(3, 1, 1)).abs().max() <= 6


def test_imagefolder_keeps_the_centre_of_a_wide_image(tmp_path):
    from PIL import Image

    image = Image.new("RGB", (100, 20), (0, 0, 255))
    image.paste((255, 0, 0), (20, 0, 80, 20))  # red in the middle 60 px
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        image.save(tmp_path / name / "wide.png")
        image.save(tmp_path / name / "wide2.png")
    split = load_data(str(tmp_path), variant="small", image_size=16)
    # 100x20 -> 80x16 -> centre 16 columns (32..47) are all inside the red band.
    assert torch.equal(split.train.images[0], torch.tensor([255, 0, 0], dtype=torch.uint8)
                       .view(3, 1, 1).expand(3, 16, 16))


def test_imagefolder_turns_grey_and_transparent_images_into_rgb(tmp_path):
    write_image(tmp_path / "grey" / "0.png", (20, 20), 77, mode="L")
    write_image(tmp_path / "grey" / "1.png", (20, 20), 77, mode="L")
    write_image(tmp_path / "alpha" / "0.png", (20, 20), (10, 20, 30, 128), mode="RGBA")
    write_image(tmp_path / "alpha" / "1.png", (20, 20), (10, 20, 30, 128), mode="RGBA")
    split = load_data(str(tmp_path), variant="small", image_size=8, val_fraction=0.5)
    every = torch.cat([split.train.images[:], split.val.images[:]])  # read from the cache
    labels = torch.cat([split.train.labels, split.val.labels])
    grey = split.classes.index("grey")
    assert every.shape[1] == 3
    assert pixel(every[labels == grey][0], 4, 4) == [77, 77, 77]
    assert pixel(every[labels != grey][0], 4, 4) == [10, 20, 30]


# --------------------------------------------------------------------------- CIFAR-10

def test_cifar10_reads_the_python_batches_through_torchvision(tmp_path):
    batches = write_cifar10(tmp_path, train_batches=2, per_batch=30, test=20)
    split = load_data(f"cifar10:{tmp_path}", variant="small", image_size=32)
    assert split.classes == CIFAR_CLASSES
    assert split.source == f"cifar10:{tmp_path}"
    assert split.train.images.shape == (60, 3, 32, 32)
    # The test batch is the validation set.
    assert split.val.images.shape == (20, 3, 32, 32)
    first = batches["data_batch_1"]
    # A row is 1024 red, 1024 green, 1024 blue values, each a 32x32 image row by row.
    assert torch.equal(split.train.images[0],
                       torch.from_numpy(first["data"][0].reshape(3, 32, 32)))
    assert torch.equal(split.val.images[19],
                       torch.from_numpy(batches["test_batch"]["data"][19].reshape(3, 32, 32)))
    assert split.train.labels.tolist() == batches["data_batch_1"]["labels"] + \
        batches["data_batch_2"]["labels"]
    assert split.val.labels.tolist() == batches["test_batch"]["labels"]


def test_cifar10_accepts_the_extracted_folder_itself(tmp_path):
    write_cifar10(tmp_path, train_batches=1)
    split = load_data(f"cifar10:{tmp_path / CIFAR_FOLDER}", variant="small", image_size=32)
    assert len(split.train) == 30 and len(split.val) == 20


def test_cifar10_classes_keeps_the_first_n_classes(tmp_path):
    write_cifar10(tmp_path, train_batches=2, per_batch=30, test=20)
    split = load_data(f"cifar10:{tmp_path}", variant="small", image_size=32, classes=3)
    assert split.classes == CIFAR_CLASSES[:3]
    assert set(split.train.labels.tolist()) == {0, 1, 2}
    assert set(split.val.labels.tolist()) == {0, 1, 2}
    assert len(split.train) == 18 and len(split.val) == 6


@pytest.mark.parametrize("classes", [1, 11])
def test_cifar10_classes_out_of_range_is_a_usage_error(tmp_path, classes):
    write_cifar10(tmp_path, train_batches=1)
    with pytest.raises(UsageError, match=f"--classes {classes}"):
        load_data(f"cifar10:{tmp_path}", variant="small", image_size=32, classes=classes)


def test_cifar10_without_test_batch_holds_out_part_of_the_training_batches(tmp_path):
    write_cifar10(tmp_path, train_batches=2, per_batch=30, with_test=False)
    split = load_data(f"cifar10:{tmp_path}", variant="small", image_size=32,
                           val_fraction=0.5)
    assert len(split.train) == 30 and len(split.val) == 30
    assert torch.bincount(split.val.labels).tolist() == [3] * 10
    train = {bytes(image.numpy()) for image in split.train.images}
    assert not any(bytes(image.numpy()) in train for image in split.val.images)


# --------------------------------------------------------------------------- the split

def test_stratified_split_is_disjoint_complete_and_takes_the_same_share_of_each_class():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    train, val = data.stratified_split(labels, 0.2)
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(100))
    assert torch.bincount(labels[val]).tolist() == [10, 6, 4]


def test_stratified_split_never_moves():
    labels = torch.arange(60) % 3
    first = data.stratified_split(labels, 0.25)
    second = data.stratified_split(labels, 0.25)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    # Shuffled within each class, not the first members.
    assert first[1].tolist() != [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def test_stratified_split_keeps_at_least_one_image_per_class_on_each_side():
    train, val = data.stratified_split(torch.tensor([0, 0, 1, 1, 1]), 0.01)
    assert torch.bincount(torch.tensor([0, 0, 1, 1, 1])[val]).tolist() == [1, 1]
    assert len(train) == 3


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_validation_fraction_outside_zero_to_one_is_a_usage_error(fraction):
    with pytest.raises(UsageError, match="--val-fraction"):
        data.stratified_split(torch.arange(10) % 2, fraction)


# --------------------------------------------------------------------------- batches

def test_epoch_batches_cover_every_sample_once_with_a_short_last_batch():
    batches = data.epoch_batches(23, 5, seed=1, epoch=0)
    assert [len(b.indices) for b in batches] == [5, 5, 5, 5, 3]
    assert [b.step for b in batches] == [0, 1, 2, 3, 4]
    assert sorted(torch.cat([b.indices for b in batches]).tolist()) == list(range(23))
    assert data.steps_per_epoch(23, 5) == 5


def test_epoch_batches_are_fixed_by_seed_and_epoch():
    def flat(seed, epoch):
        batches = data.epoch_batches(40, 8, seed=seed, epoch=epoch)
        return torch.cat([b.indices for b in batches]), torch.cat([b.flips for b in batches])

    same = flat(3, 2), flat(3, 2)
    assert torch.equal(same[0][0], same[1][0]) and torch.equal(same[0][1], same[1][1])
    assert not torch.equal(flat(3, 2)[0], flat(3, 3)[0])
    assert not torch.equal(flat(3, 2)[0], flat(4, 2)[0])
    flips = flat(3, 2)[1]
    assert 0 < int(flips.sum()) < len(flips)


def test_augmentation_of_a_sample_does_not_depend_on_the_batch_size():
    def flips_by_sample(batch_size):
        batches = data.epoch_batches(50, batch_size, seed=0, epoch=1)
        return {int(i): bool(f) for b in batches for i, f in zip(b.indices, b.flips)}

    assert flips_by_sample(4) == flips_by_sample(7) == flips_by_sample(50)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_splitting_a_global_batch_into_parts_keeps_its_samples_and_flips(parts):
    for batch in data.epoch_batches(37, 12, seed=5, epoch=0):
        bounds = np.linspace(0, len(batch.indices), parts + 1).astype(int)
        pieces = [batch.part(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        assert all(p.step == batch.step for p in pieces)
        assert torch.equal(torch.cat([p.indices for p in pieces]), batch.indices)
        assert torch.equal(torch.cat([p.flips for p in pieces]), batch.flips)


def test_batch_size_below_one_is_a_usage_error():
    with pytest.raises(UsageError, match="--batch-size 0"):
        data.epoch_batches(10, 0, seed=0, epoch=0)


def test_batch_transform_normalises_with_the_imagenet_statistics_exactly():
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    x = data.BatchTransform(4)(images.contiguous())
    assert x.dtype == torch.float32 and x.shape == (2, 3, 4, 4)
    expected = [(v / 255 - m) / s for v, m, s in zip((0, 51, 255), RGB_MEAN, RGB_STD)]
    assert torch.allclose(x[1, :, 2, 3], torch.tensor(expected), atol=1e-6)


def test_batch_transform_flips_exactly_the_marked_samples():
    images = torch.randint(0, 256, (4, 3, 6, 6), dtype=torch.uint8)
    transform = data.BatchTransform(6)
    plain = transform(images)
    flipped = transform(images, torch.tensor([True, False, False, True]))
    assert torch.equal(flipped[0], plain[0].flip(-1))
    assert torch.equal(flipped[3], plain[3].flip(-1))
    assert torch.equal(flipped[1:3], plain[1:3])
    assert not torch.equal(flipped[0], plain[0])
    assert torch.equal(transform(images, torch.zeros(4, dtype=torch.bool)), plain)


def test_batch_transform_scales_stored_images_to_the_image_size():
    images = torch.full((2, 3, 64, 64), 128, dtype=torch.uint8)
    x = data.BatchTransform(32)(images)
    assert x.shape == (2, 3, 32, 32)
    assert torch.allclose(x[:, 0], torch.full((2, 32, 32), (128 / 255 - RGB_MEAN[0]) / RGB_STD[0]))


def small_image_set(n=10):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 4, 4).contiguous()
    return data.ImageSet(images, torch.arange(n) % 2, ["a", "b"])


def test_prefetcher_yields_the_transformed_batches_in_order():
    images = small_image_set()
    batches = data.epoch_batches(10, 3, seed=0, epoch=0)
    transform = data.BatchTransform(4)
    with data.BatchPrefetcher(images, batches, transform) as prefetch:
        got = list(prefetch)
    assert [s.batch.step for s, _, _ in got] == [0, 1, 2, 3]
    for share, x, y in got:
        batch = share.part
        assert torch.equal(x, transform(images.images[batch.indices], batch.flips))
        assert torch.equal(y, images.labels[batch.indices])
    assert 0.0 <= prefetch.wait_seconds


def test_prefetcher_gives_this_host_only_its_part():
    images = small_image_set()
    batches = data.epoch_batches(10, 4, seed=0, epoch=0)
    with data.BatchPrefetcher(images, batches, data.BatchTransform(4),
                              share=lambda b: data.HostShare(b, b.part(0, 2))) as prefetch:
        got = list(prefetch)
    assert [len(y) for _, _, y in got] == [2, 2, 2]
    assert all(torch.equal(y, images.labels[s.batch.indices[:2]]) for s, _, y in got)


def test_prefetcher_thread_ends_when_the_consumer_stops_early():
    images = small_image_set(60)
    batches = data.epoch_batches(60, 2, seed=0, epoch=0)
    prefetch = data.BatchPrefetcher(images, batches, data.BatchTransform(4), depth=1)
    with prefetch:
        next(iter(prefetch))
    assert not any(t.name == "hybriddl-prefetch" and t.is_alive() for t in threading.enumerate())


def test_prefetcher_raises_a_failure_of_the_producer_in_the_consumer():
    images = small_image_set()
    batches = data.epoch_batches(10, 3, seed=0, epoch=0)

    def broken(images, flips=None):
        raise ValueError("broken transform")

    with data.BatchPrefetcher(images, batches, broken) as prefetch:
        with pytest.raises(ValueError, match="broken transform"):
            list(prefetch)
