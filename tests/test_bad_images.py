"""Bad and unusual images: the cache build goes through the whole folder in one pass, converts
what it can to RGB, leaves out and lists the rest, and --strict-data refuses instead."""

import errno
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from sample_data import write_image

from hybriddl.data import cache as datacache
from hybriddl.data.cache.layout import skipped_list_path
from hybriddl.data import images, sources
from hybriddl.data.loading import data_notes, load_data
from hybriddl.errors import UsageError

GOOD = (8, 8)


def png_header_only(path, width, height):
    """A PNG whose header claims width x height 8-bit grey pixels, with no pixel data:
    kilobytes on disk, `width * height` bytes once decoded."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def make_unreadable(path, monkeypatch):
    """chmod 000. Root reads a file whatever its mode bits say (the tests run as root), so
    then the reader's open() refuses as it would for any other user."""
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = open

        def user_open(file, *args, **kwargs):
            if os.stat(file).st_mode & 0o444 == 0:
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(images, "open", user_open, raising=False)


def convertible(root):
    """Images in every mode a photo folder brings, each convertible to RGB: {file: mode}."""
    made = {}

    def save(name, image, mode, **options):
        path = root / "fire" / name
        image.save(path, **options)
        made[path] = mode

    save("grey.png", Image.new("L", GOOD, 90), "L")
    save("print.jpg", Image.new("CMYK", GOOD, (0, 200, 200, 0)), "CMYK")
    save("alpha.png", Image.new("RGBA", GOOD, (10, 20, 30, 0)), "RGBA")
    save("palette.png", Image.new("P", GOOD, 3), "P")
    save("palette-transparent.png", Image.new("P", GOOD, 1), "P", transparency=0)
    save("grey-alpha.png", Image.new("LA", GOOD, (50, 128)), "LA")
    save("bilevel.png", Image.new("1", GOOD, 1), "1")
    save("sixteen.png", Image.fromarray(np.full((8, 8), 128 * 257, dtype=np.uint16)), "I;16")
    return made


def unusable(root, monkeypatch):
    """Files of ten kinds that are no usable image: {file: words its reason must hold}."""
    smoke = root / "smoke"
    made = {}
    (smoke / "empty.png").write_bytes(b"")
    made[smoke / "empty.png"] = "not an image file"
    (smoke / "notes.jpg").write_text("a shopping list\n")
    made[smoke / "notes.jpg"] = "not an image file"
    good_png = write_image(smoke / "cut.png", (64, 64), (1, 2, 3)).read_bytes()
    (smoke / "cut.png").write_bytes(good_png[:60])
    made[smoke / "cut.png"] = "damaged image data"
    good_jpeg = write_image(smoke / "cut.jpg", (64, 64), (1, 2, 3)).read_bytes()
    (smoke / "cut.jpg").write_bytes(good_jpeg[:300])
    made[smoke / "cut.jpg"] = "damaged image data"
    Image.new("F", GOOD, 0.5).save(smoke / "float.tif")
    made[smoke / "float.tif"] = "floating-point"
    # Over PIL's limit (89,478,485 pixels): a warning at 1x, an error at 2x; both refused.
    png_header_only(smoke / "bomb-warning.png", 10_000, 10_000)
    made[smoke / "bomb-warning.png"] = "too many pixels, not decoded"
    png_header_only(smoke / "bomb-error.png", 20_000, 20_000)
    made[smoke / "bomb-error.png"] = "too many pixels, not decoded"
    os.symlink("nowhere.png", smoke / "dangling.png")
    made[smoke / "dangling.png"] = "broken symbolic link to nowhere.png"
    os.mkfifo(smoke / "pipe.png")  # opening it would wait for a writer forever
    made[smoke / "pipe.png"] = "not a regular file"
    locked = write_image(smoke / "locked.png", GOOD, (4, 5, 6))
    make_unreadable(locked, monkeypatch)
    made[locked] = "permission denied"
    return made


def rows_by_file(cache):
    return {cache.source.where(int(item)): row for row, item in enumerate(cache.items)}


def test_a_folder_of_many_kinds_builds_in_one_pass_and_lists_what_it_left_out(tmp_path,
                                                                           monkeypatch):
    root = tmp_path / "photos"
    good = [write_image(root / cls / f"{i}.png", GOOD, (200, 60 * i, 9)) for cls in ("fire", "smoke")
            for i in range(3)]
    converted = convertible(root)
    bad = unusable(root, monkeypatch)
    calls = []
    source = sources.ImageFolderSource(str(root), 8)
    cache, every = datacache.open_cache(source, tmp_path / "cache",
                                        progress=lambda done, total: calls.append((done, total)))
    total = len(good) + len(converted) + len(bad)
    assert calls[-1] == (total, total)
    assert len(every) == len(good) + len(converted)
    rows = rows_by_file(cache)
    assert set(rows) == {str(path) for path in good + list(converted)}
    skipped = dict(cache.header["skipped"])
    assert set(skipped) == {str(path) for path in bad}
    for path, words in bad.items():
        assert words in skipped[str(path)], (path, skipped[str(path)])
    assert cache.header["converted"] == {"L": 1, "CMYK": 1, "RGBA": 1, "P": 2, "LA": 1, "1": 1,
                                         "I;16": 1}
    # 16 bits scaled to 8 (PIL's own convert clips them at 255: white).
    assert torch.all(every.images[rows[str(root / "fire" / "sixteen.png")]] == 128)
    assert torch.all(every.images[rows[str(root / "fire" / "grey.png")]] == 90)
    listed = skipped_list_path(cache.path).read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(map(str, bad))
    summary = cache.summary()
    assert summary.startswith(f"{len(bad)} of {total} files of imagefolder:{root} skipped")
    assert summary.endswith(f"see {skipped_list_path(cache.path)}")
    calls.clear()
    again, _ = datacache.open_cache(sources.ImageFolderSource(str(root), 8), tmp_path / "cache")
    assert calls == [] and again.header["skipped"] == cache.header["skipped"]


def test_a_removed_list_of_skipped_files_is_written_again(tmp_path):
    root = tmp_path / "photos"
    for cls in ("fire", "smoke"):
        for i in range(3):
            write_image(root / cls / f"{i}.png", GOOD, (i, 2, 3))
    (root / "fire" / "junk.png").write_bytes(b"junk")
    cache, _ = datacache.open_cache(sources.ImageFolderSource(str(root), 8), tmp_path / "cache")
    listed = skipped_list_path(cache.path)
    before = listed.read_text()
    listed.unlink()
    datacache.open_cache(sources.ImageFolderSource(str(root), 8), tmp_path / "cache")
    assert listed.read_text() == before == f"{root / 'fire' / 'junk.png'}\tnot an image file PIL can identify\n"


def test_a_symlink_loop_is_followed_once_and_named(tmp_path):
    root = tmp_path / "photos"
    for cls in ("fire", "smoke"):
        for i in range(3):
            write_image(root / cls / "deeper" / f"{i}.png", GOOD, (i, 2, 3))
    os.symlink("..", root / "fire" / "deeper" / "up")  # back to fire/
    os.symlink(root / "smoke", root / "smoke" / "self")
    source = sources.ImageFolderSource(str(root), 8)
    assert source.count() == 6, "torchvision's walk listed each image again at every level"
    problems = dict(source.problems())
    assert problems == {str(root / "fire" / "deeper" / "up"):
                        f"symlink loop back to {root / 'fire'}: not read again",
                        str(root / "smoke" / "self"):
                        f"symlink loop back to {root / 'smoke'}: not read again"}
    split = load_data(str(root), variant="small", image_size=8, cache_dir=str(tmp_path / "cache"),
                      val_fraction=0.34)
    assert len(split.train) + len(split.val) == 6
    notes = data_notes(split)
    assert len(notes) == 1 and "0 of 6 files" in notes[0] and "2 folders not read" in notes[0]


def test_an_empty_class_folder_is_one_clear_line(tmp_path):
    root = tmp_path / "photos"
    write_image(root / "fire" / "0.png", GOOD, (1, 2, 3))
    write_image(root / "fire" / "1.png", GOOD, (1, 2, 3))
    (root / "smoke").mkdir()
    (root / "smoke" / "readme.txt").write_text("to do\n")
    with pytest.raises(UsageError, match=r"class folder\(s\) 'smoke' hold no image file"):
        load_data(str(root), variant="small", image_size=8, cache_dir=str(tmp_path / "cache"))


def test_a_class_left_without_a_usable_image_is_refused_naming_the_list(tmp_path):
    root = tmp_path / "photos"
    for i in range(3):
        write_image(root / "fire" / f"{i}.png", GOOD, (1, 2, 3))
    (root / "smoke").mkdir()
    (root / "smoke" / "0.png").write_bytes(b"junk")
    with pytest.raises(UsageError, match=r"'smoke' have no usable image; 1 of 4 files .*"
                                         r"skipped .*skipped\.txt"):
        load_data(str(root), variant="small", image_size=8, cache_dir=str(tmp_path / "cache"))


def test_strict_data_refuses_naming_the_list_and_keeps_the_cache(tmp_path):
    root = tmp_path / "photos"
    for cls in ("fire", "smoke"):
        for i in range(3):
            write_image(root / cls / f"{i}.png", GOOD, (i, 2, 3))
    (root / "smoke" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    split = load_data(str(root), variant="small", image_size=8, cache_dir=str(tmp_path / "cache"))
    assert len(split.train) + len(split.val) == 6
    built = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    with pytest.raises(UsageError, match=r"--strict-data: 1 of 7 files .*broken\.png.*see "
                                         r".*\.skipped\.txt"):
        load_data(str(root), variant="small", image_size=8, cache_dir=str(tmp_path / "cache"),
                  strict=True)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == built


@pytest.fixture
def photos_with_junk(tmp_path):
    root = tmp_path / "photos"
    for cls, colour in (("fire", (230, 80, 10)), ("smoke", (150, 150, 150))):
        for i in range(4):
            write_image(root / cls / f"{i}.png", (24, 24), colour)
    Image.new("CMYK", (24, 24), (0, 200, 200, 0)).save(root / "fire" / "print.jpg")
    (root / "smoke" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    return root


TRAIN = ("--model", "squeezenet1_1", "--image-size", "32", "--strategy", "sequential",
         "--batch-size", "2", "--epochs", "1", "--max-steps", "1", "--monitor-interval", "0")


@pytest.mark.slow
def test_train_shows_the_summary_and_strict_data_exits_2_in_one_line(cli, cli_here, tmp_path,
                                                                      photos_with_junk):
    cache = tmp_path / "cache"
    strict = cli_here("train", "--data", str(photos_with_junk), "--data-cache", str(cache),
                      "--strict-data", *TRAIN, "--run-dir", str(tmp_path / "strict"))
    assert strict.returncode == 2, strict.stderr
    lines = strict.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in strict.stderr
    assert "--strict-data: 1 of 10 files" in lines[0] and "broken.png" in lines[0]
    listed = next(cache.glob("*.skipped.txt"))
    assert f"see {listed}" in lines[0]
    assert not (tmp_path / "strict").exists()
    done = cli("train", "--data", str(photos_with_junk), "--data-cache", str(cache), *TRAIN,
               "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert f"1 of 10 files of imagefolder:{photos_with_junk} skipped" in done.stderr
    assert f"see {listed}" in done.stderr
    assert "1 image of" in done.stderr and "converted to RGB (1 CMYK)" in done.stderr


@pytest.mark.slow
def test_tune_shows_the_same_summary(cli, tmp_path, photos_with_junk):
    """`hybriddl tune --data` measures on the same cache, and says what it left out. A
    budget of 2 s: the baseline is measured whatever the budget, and the summary is the
    data's, not the candidates'."""
    done = cli("tune", "--usecase", "ComplexSmall", "--model", "squeezenet1_1", "--image-size",
               "32", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--second-look", "0",
               "--budget", "2", "--data", str(photos_with_junk), "--data-cache", str(tmp_path / "cache"),
               "--output", str(tmp_path / "profile.json"))
    assert done.returncode == 0, done.stderr
    assert f"1 of 10 files of imagefolder:{photos_with_junk} skipped" in done.stderr
    assert "converted to RGB (1 CMYK)" in done.stderr
