"""The streamed data path: one cache file per source and size, reused, rebuilt, read per part."""

import os
import signal
from collections import namedtuple

import numpy as np
import pytest
import torch
from sample_data import CIFAR_FOLDER, write_cifar10, write_image, write_imagefolder

from hybriddl import data
from hybriddl.data.loading import load_data
from hybriddl.data import cache as datacache
from hybriddl.data.cache import building, layout, reading
from hybriddl.data import sources
from hybriddl.errors import TrainingError, UsageError
from hybriddl.data.sharding import split_bounds


class Calls(list):
    """A progress callback that remembers what it was told."""

    def __call__(self, done, total):
        self.append((done, total))


def load(spec, cache, image_size=16, **options):
    progress = Calls()
    split = load_data(spec, variant="small", image_size=image_size, cache_dir=str(cache),
                           progress=progress, **options)
    return split, progress


def cache_file(cache):
    files = [p for p in cache.iterdir() if p.suffix == ".cache"]
    assert len(files) == 1, files
    return files[0]


def every_image(split):
    return torch.cat([split.train.images[:], split.val.images[:]])


# --------------------------------------------------------------------------- reuse and rebuild

def test_a_second_run_reuses_the_cache_without_decoding(tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=5)
    first, built = load(str(root), tmp_path / "cache")
    stamp = cache_file(tmp_path / "cache").stat().st_mtime_ns
    second, reused = load(str(root), tmp_path / "cache")
    assert built[-1] == (10, 10) and reused == []
    assert cache_file(tmp_path / "cache").stat().st_mtime_ns == stamp
    assert torch.equal(every_image(first), every_image(second))
    assert torch.equal(first.train.labels, second.train.labels)


def test_each_image_size_has_its_own_cache(tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=3)
    load(str(root), tmp_path / "cache", image_size=16)
    split, built = load(str(root), tmp_path / "cache", image_size=8)
    assert built and split.train.images.shape[-2:] == (8, 8)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.suffix == ".cache"]) == 2


def change_by_adding(root):
    write_image(root / "fire" / "new.png", (20, 20), (1, 2, 3))


def change_by_removing(root):
    next((root / "smoke").iterdir()).unlink()


def change_by_modifying(root):
    target = sorted((root / "fire").iterdir())[0]
    write_image(target.with_suffix(target.suffix), (20, 20), (1, 2, 3))
    os.utime(target, ns=(1, 1))  # another mtime even on a coarse-grained file system


@pytest.mark.parametrize("change", [change_by_adding, change_by_removing, change_by_modifying])
def test_a_changed_source_is_rebuilt(tmp_path, change):
    root = write_imagefolder(tmp_path / "images", per_class=5)
    before, _ = load(str(root), tmp_path / "cache")
    change(root)
    after, rebuilt = load(str(root), tmp_path / "cache")
    assert rebuilt, "the changed folder must be decoded again"
    expected = {change_by_adding: 11, change_by_removing: 9, change_by_modifying: 10}[change]
    assert len(after.train) + len(after.val) == expected
    if change is change_by_modifying:
        assert not torch.equal(every_image(before), every_image(after))
    cache_file(tmp_path / "cache")  # the stale cache was replaced, not kept beside


class Counting:
    """Mixin: remembers from which image a build started decoding."""

    started_at = None

    def items(self, start):
        if self.started_at is None:  # the build's call, not a repair's
            self.started_at = start
        yield from super().items(start)


class CountingSynthetic(Counting, sources.SyntheticSource):
    pass


class CountingFolder(Counting, sources.ImageFolderSource):
    pass


def test_interrupted_build_continues_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(building, "SYNC_EVERY_SECONDS", 0.0)  # every image is a sync point
    cache = tmp_path / "cache"
    stops = iter([None] * 9 + [signal.SIGINT])
    with pytest.raises(building.CacheBuildInterrupted, match="10 of 40 images kept") as caught:
        datacache.open_cache(sources.SyntheticSource(40), cache, stop_signal=lambda: next(stops))
    assert caught.value.exit_code == 130
    assert not [p for p in cache.iterdir() if p.suffix == ".cache"], \
        "an unfinished build must never look like a cache"
    source = CountingSynthetic(40)
    _, resumed = datacache.open_cache(source, cache)
    assert source.started_at == 10
    _, fresh = datacache.open_cache(sources.SyntheticSource(40), tmp_path / "fresh")
    assert torch.equal(resumed.images[:], fresh.images[:])
    assert torch.equal(resumed.labels, fresh.labels)
    assert sorted(p.name.split(".", 1)[1] for p in cache.iterdir()) == ["cache", "cache.lock"]


def test_an_interrupted_build_keeps_the_files_it_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(building, "SYNC_EVERY_SECONDS", 0.0)
    root = write_imagefolder(tmp_path / "images", per_class=5)
    (root / "fire" / "0a.png").write_bytes(b"not an image")  # the 2nd item of 11
    stops = iter([None] * 3 + [signal.SIGTERM])
    with pytest.raises(building.CacheBuildInterrupted):
        datacache.open_cache(sources.ImageFolderSource(str(root), 16), tmp_path / "cache",
                             stop_signal=lambda: next(stops))
    source = CountingFolder(str(root), 16)
    cache, every = datacache.open_cache(source, tmp_path / "cache")
    assert source.started_at == 4
    assert cache.header["skipped"] == [[str(root / "fire" / "0a.png"),
                                        "not an image file PIL can identify"]]
    _, fresh = datacache.open_cache(sources.ImageFolderSource(str(root), 16), tmp_path / "fresh")
    assert torch.equal(every.images[:], fresh.images[:]) and len(every) == 10


def test_a_stop_ends_the_wait_for_another_process_building_the_cache(tmp_path, monkeypatch):
    """A second process (a second rank of the machine, a tune) waits while another builds
    the cache; a stop requested meanwhile ends that wait, and a folder whose file system
    cannot lock is one line."""
    import errno
    import fcntl

    monkeypatch.setattr(datacache, "LOCK_POLL_SECONDS", 0.01)
    cache = tmp_path / "cache"
    cache.mkdir()
    source = sources.SyntheticSource(40)
    asked = []

    def stop_after_three():
        asked.append(None)
        return signal.SIGTERM if len(asked) == 3 else None

    with open(cache / (source.cache_name() + ".lock"), "w") as held:  # another builder's
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(building.CacheBuildInterrupted,
                           match="waiting for another process to build") as caught:
            datacache.open_cache(source, cache, stop_signal=stop_after_three)
    assert len(asked) == 3 and caught.value.exit_code == 143
    assert not [p for p in cache.iterdir() if p.suffix == ".cache"]
    _, images = datacache.open_cache(source, cache)  # the lock free: built
    assert len(images) == 40

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UsageError, match="cannot lock .* give a local folder"):
        datacache.open_cache(sources.SyntheticSource(41), cache)


def test_a_disk_failing_under_the_cache_is_one_line_naming_it(tmp_path, monkeypatch):
    """EIO while building or reading the cache (a failing disk, an NFS file another host
    replaced), or a quota met mid-build, is one line naming the file, not a traceback from
    the prefetcher's thread; what the build synced is kept."""
    import errno

    monkeypatch.setattr(building, "SYNC_EVERY_SECONDS", 0.0)
    cache = tmp_path / "cache"
    writes = []

    def failing_write(fd, data, offset):
        writes.append(offset)
        if len(writes) == 5:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_write(fd, data, offset)

    real_write = os.pwrite
    monkeypatch.setattr(building.os, "pwrite", failing_write)
    with pytest.raises(TrainingError, match=r"could not be built: Input/output error; check"):
        datacache.open_cache(sources.SyntheticSource(40), cache)
    writes.clear()
    errno_quota = errno.EDQUOT

    def over_quota(fd, data, offset):
        raise OSError(errno_quota, os.strerror(errno_quota))

    monkeypatch.setattr(building.os, "pwrite", over_quota)
    with pytest.raises(UsageError, match="no space left for the cache"):
        datacache.open_cache(sources.SyntheticSource(40), cache)
    monkeypatch.setattr(building.os, "pwrite", real_write)
    source = CountingSynthetic(40)
    _, images = datacache.open_cache(source, cache)
    assert source.started_at > 0  # went on from what the failed build synced

    def failing_read(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(reading.os, "preadv", failing_read)
    with pytest.raises(TrainingError, match=r"reading image 0 failed \(Input/output error\)"):
        images.images[:1]


def test_the_writable_check_leaves_another_hosts_probe_alone(tmp_path):
    """Hosts sharing a cache folder on NFS may run processes of the same pid: each one's
    check that it can write there must not take the other's file away under it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    theirs = cache / f".probe-{os.getpid()}"  # another host's process of this pid, checking
    theirs.write_bytes(b"")
    datacache.open_cache(sources.SyntheticSource(8), cache)
    assert theirs.exists()


def test_interrupted_build_of_a_since_changed_source_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(building, "SYNC_EVERY_SECONDS", 0.0)
    root = write_imagefolder(tmp_path / "images", per_class=5)
    stops = iter([None] * 3 + [signal.SIGTERM])
    with pytest.raises(building.CacheBuildInterrupted) as caught:
        datacache.open_cache(sources.ImageFolderSource(str(root), 16), tmp_path / "cache",
                             stop_signal=lambda: next(stops))
    assert caught.value.exit_code == 143
    change_by_modifying(root)
    source = CountingFolder(str(root), 16)
    _, after = datacache.open_cache(source, tmp_path / "cache")
    assert source.started_at == 0
    _, fresh = datacache.open_cache(sources.ImageFolderSource(str(root), 16), tmp_path / "fresh")
    assert torch.equal(after.images[:], fresh.images[:])


def damage_by_truncating(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


def damage_the_header(path):
    header = layout.read_header(path)
    with open(path, "r+b") as handle:
        handle.seek(layout.header_at(header["count"], header["stored_size"]) + 1)
        handle.write(b"\xff\xfe")


def damage_the_labels(path):
    header = layout.read_header(path)
    records_at = (layout.header_at(header["count"], header["stored_size"])
                  - header["count"] * layout.RECORD.itemsize)
    with open(path, "r+b") as handle:
        handle.seek(records_at)
        handle.write(np.int64(1).tobytes())
        handle.seek(records_at + layout.RECORD.itemsize)
        handle.write(np.int64(0).tobytes())


def damage_by_an_old_format(path):
    """A cache of format 1 (hybriddl before skipped files were listed) is rebuilt."""
    path.write_bytes(b"HYBRIDDL-CACHE1\n" + path.read_bytes()[16:])


@pytest.mark.parametrize("damage", [damage_by_truncating, damage_the_header, damage_the_labels,
                                    damage_by_an_old_format])
def test_a_damaged_cache_is_detected_and_rebuilt(tmp_path, damage):
    root = write_imagefolder(tmp_path / "images", per_class=5)
    before, _ = load(str(root), tmp_path / "cache")
    expected = every_image(before)
    damage(cache_file(tmp_path / "cache"))
    after, rebuilt = load(str(root), tmp_path / "cache")
    assert rebuilt[-1] == (10, 10)
    assert torch.equal(every_image(after), expected)
    assert torch.equal(before.train.labels, after.train.labels)


def flip_a_byte_of_image(path, row, offset=5):
    header = layout.read_header(path)
    with open(path, "r+b") as handle:
        handle.seek(layout.IMAGES_AT + row * 3 * header["stored_size"] ** 2 + offset)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_a_flipped_byte_is_caught_named_and_the_row_rebuilt(tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=5)
    source = sources.ImageFolderSource(str(root), 16)
    cache, every = datacache.open_cache(source, tmp_path / "cache")
    expected = every.images[:]
    flip_a_byte_of_image(cache.path, 3)
    cache, every = datacache.open_cache(sources.ImageFolderSource(str(root), 16),
                                        tmp_path / "cache")
    assert cache.repairs == []  # opening checks the header and records, not every image
    assert torch.equal(every.images[[5, 3, 0]], expected[[5, 3, 0]])
    file = source.where(int(cache.items[3]))
    assert len(cache.repairs) == 1
    assert f"{cache.path}: image 3 ({file})" in cache.repairs[0]
    assert "written back" in cache.repairs[0]
    again, every = datacache.open_cache(sources.ImageFolderSource(str(root), 16),
                                        tmp_path / "cache")
    assert torch.equal(every.images[:], expected) and again.repairs == []


def test_a_damaged_row_that_its_file_no_longer_gives_is_refused(tmp_path, monkeypatch):
    cache, every = datacache.open_cache(sources.SyntheticSource(30), tmp_path / "cache")
    flip_a_byte_of_image(cache.path, 0)
    cache, every = datacache.open_cache(sources.SyntheticSource(30), tmp_path / "cache")
    other = sources.Item(0, np.zeros((3, 64, 64), dtype=np.uint8))
    monkeypatch.setattr(cache.source, "item", lambda index: other)
    with pytest.raises(TrainingError, match=f"{cache.path}: image 0 .*does not match its "
                                            "checksum.*delete"):
        every.images[[3, 0]]
    assert every.images[[1, 2]].shape == (2, 3, 64, 64)


# --------------------------------------------------------------------------- where it is kept

def test_cache_dir_that_cannot_be_written_is_one_line_exit_2(cli, tmp_path):
    root = write_imagefolder(tmp_path / "images", per_class=3)
    (tmp_path / "file").write_text("not a folder\n")
    done = cli("train", "--data", str(root), "--data-cache", str(tmp_path / "file" / "cache"),
               "--model", "squeezenet1_1", "--image-size", "32", "--strategy", "sequential",
               "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "--data-cache" in done.stderr and "writable" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_tune_reads_its_data_through_the_same_cache(cli, tmp_path):
    (tmp_path / "file").write_text("not a folder\n")
    done = cli("tune", "--usecase", "SimpleBig", "--data", "synthetic:40", "--data-cache",
               str(tmp_path / "file" / "cache"), "--output", str(tmp_path / "profile.json"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "--data-cache" in done.stderr
    assert not (tmp_path / "profile.json").exists()


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(building.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    with pytest.raises(UsageError, match=r"needs 0\.00 GiB but only 0\.00 GiB is free"):
        datacache.open_cache(sources.SyntheticSource(20), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if "partial" in p.name] == []


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert datacache.default_cache_dir() == tmp_path / "hybriddl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(datacache.default_cache_dir()).endswith(os.path.join(".cache", "hybriddl"))


# --------------------------------------------------------------------------- reading

@pytest.mark.parametrize("weights", [[1.0, 1.0], [3.0, 1.0, 2.0]])
def test_each_host_reads_only_its_part_of_each_global_batch(tmp_path, weights):
    split, _ = load("synthetic:60", tmp_path / "cache", image_size=64)
    every_batch = data.epoch_batches(len(split.train), 10, seed=3, epoch=1)
    transform = data.BatchTransform(64)
    expected = {b.step: transform(split.train.images[b.indices], b.flips) for b in every_batch}
    for rank in range(len(weights)):
        mine = split.train.subset(torch.arange(len(split.train)))  # a fresh view, counter at 0

        def host_share(batch, rank=rank):
            return data.HostShare(batch, batch.part(*split_bounds(len(batch.indices), weights)[rank]))

        with data.BatchPrefetcher(mine, every_batch, transform, share=host_share) as prefetch:
            got = list(prefetch)
        shares = [host_share(b).samples for b in every_batch]
        assert mine.images.rows_read == sum(shares)
        for (got_share, x, y), share in zip(got, shares):
            batch = got_share.batch
            start, stop = split_bounds(len(batch.indices), weights)[rank]
            assert len(y) == share
            assert torch.equal(x, expected[batch.step][start:stop])
            assert torch.equal(y, split.train.labels[batch.indices[start:stop]])


def test_a_split_reads_no_image_until_a_batch_asks(tmp_path):
    split, _ = load("synthetic:30", tmp_path / "cache", image_size=64)
    assert split.train.images.rows_read == 0 and split.val.images.rows_read == 0
    assert isinstance(split.train, reading.StreamedImageSet)


def test_synthetic_n_generates_each_image_from_its_index(tmp_path):
    split, built = load("synthetic:50", tmp_path / "cache", image_size=32)
    assert built[-1] == (50, 50)
    assert split.classes == data.SYNTHETIC_CLASSES
    assert len(split.train) + len(split.val) == 50
    assert torch.bincount(torch.cat([split.train.labels, split.val.labels])).tolist() == [17, 17, 16]
    index = int(split.train.images.cache.items[split.train.images._positions[4]])
    assert np.array_equal(split.train.images[4].numpy(),
                          data.render_synthetic(index % 3, index, sources.SYNTHETIC_SIZE))


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:1", "synthetic:ten", "synthetic:-5"])
def test_synthetic_n_needs_a_whole_number_of_at_least_two(tmp_path, spec):
    with pytest.raises(UsageError, match="synthetic:N"):
        load(spec, tmp_path / "cache")


def test_cifar10_goes_through_the_cache_once(tmp_path):
    write_cifar10(tmp_path / "cifar", train_batches=2, per_batch=30, test=20)
    first, built = load(f"cifar10:{tmp_path / 'cifar'}", tmp_path / "cache", image_size=32)
    second, reused = load(f"cifar10:{tmp_path / 'cifar' / CIFAR_FOLDER}", tmp_path / "cache",
                          image_size=64, classes=4)
    assert built[-1] == (80, 80) and reused == []  # same folder, stored at 32 px for every size
    assert (len(second.train), len(second.val)) == (24, 8)
    assert torch.equal(second.val.images[:], first.val.images[:][first.val.labels < 4])


# --------------------------------------------------------------------------- bigger than memory

@pytest.mark.slow
def test_an_imagefolder_bigger_than_the_old_memory_limit_trains(tmp_path, monkeypatch):
    """The old loader refused a folder whose decoded size exceeded half the free RAM."""
    from hybriddl.run import trainer
    from hybriddl.strategies import StrategyOptions

    root = write_imagefolder(tmp_path / "images", per_class=6,
                             classes={"fire": (230, 80, 10), "smoke": (150, 150, 150)})
    decoded = 12 * 3 * 32 * 32
    Memory = namedtuple("Memory", "total available percent used free")
    # Free RAM as small as the decoded folder: the old rule (<= half of it) would refuse.
    monkeypatch.setattr("psutil.virtual_memory",
                        lambda: Memory(decoded, decoded, 100.0, decoded, 0))
    config = trainer.TrainConfig(usecase="SimpleBig", model="squeezenet1_1", data=str(root),
                                 data_cache=str(tmp_path / "cache"), image_size=32, batch_size=4,
                                 epochs=1, max_steps=2, strategy="sequential",
                                 strategy_options=StrategyOptions(), monitor_interval=0,
                                 run_dir=str(tmp_path / "run"), val_fraction=0.25)
    prepared = trainer.prepare(config.resolved())
    assert isinstance(prepared.split.train, reading.StreamedImageSet)
    metrics = trainer.run(prepared)
    assert [e["steps"] for e in metrics["epochs"]] == [2]
    assert metrics["config"]["data"]["train_images"] == 8  # 2 of each class of 6 held out


def test_a_stop_in_one_hosts_cache_build_stops_every_host_together(tmp_path, monkeypatch):
    """A host whose data is ready goes on to the hosts' next exchange: when another host's
    build is stopped, every host stops after the data, together (the ready one waited in
    that exchange while the stopped one left), each saying why, with the signal's exit code."""
    from hybriddl.hosts.cluster import SingleHost
    from hybriddl.run import trainer
    from hybriddl.strategies import StrategyOptions

    class OneOfTwo(SingleHost):
        """Rank `rank` of 2; the other rank's allgather value is `other`."""
        size = 2

        def __init__(self, rank: int, other):
            super().__init__()
            self.rank, self.other, self.told = rank, other, []

        def allgather(self, value):
            self.told.append(value)
            return [value, self.other] if self.rank == 0 else [self.other, value]

    class Stop:
        signum = signal.SIGTERM

    monkeypatch.setattr(building, "SYNC_EVERY_SECONDS", 0.0)  # every image is a sync point
    root = write_imagefolder(tmp_path / "images", per_class=6,
                             classes={"fire": (230, 80, 10), "smoke": (150, 150, 150)})

    def config(rank: int):
        return trainer.TrainConfig(
            usecase="SimpleBig", model="squeezenet1_1", data=str(root),
            data_cache=str(tmp_path / f"cache{rank}"), image_size=32, batch_size=4, epochs=1,
            strategy="sequential", strategy_options=StrategyOptions(), monitor_interval=0,
            run_dir=str(tmp_path / "run"), val_fraction=0.25).resolved()

    stopped = OneOfTwo(0, 0)  # its build stopped by SIGTERM: it tells the other host
    with pytest.raises(building.CacheBuildInterrupted, match="images kept") as caught:
        trainer.prepare(config(0), hosts=stopped, stop=Stop())
    assert stopped.told == [signal.SIGTERM] and caught.value.exit_code == 143
    ready = OneOfTwo(1, int(signal.SIGTERM))  # its data ready, no stop of its own
    with pytest.raises(building.CacheBuildInterrupted,
                       match="stopped while rank 0 built its data cache") as caught:
        trainer.prepare(config(1), hosts=ready)
    assert ready.told == [0] and caught.value.exit_code == 143
    assert not (tmp_path / "run").exists()
    # With no stop anywhere, the data is the run's; every host agrees after its data and
    # after its tune (none here: a named strategy), so the hosts' exchanges match.
    quiet = OneOfTwo(1, 0)
    assert len(trainer.prepare(config(1), hosts=quiet).split.train) == 8
    assert quiet.told == [0, 0]
