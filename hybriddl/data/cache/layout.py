"""The cache file's layout, format 2 (files of format 1 are rebuilt).

MAGIC, then the header's offset and length (zero until the build completes); images from
ROW_ALIGN on, one row of 3 x S x S uint8 each; one record per image (label, CRC-32, the
source item it came from); then the header, sorted-key JSON. The header comes last because
how many images a folder really gives is known only once every file was tried. A text file
beside the cache lists the files left out (`skipped_list_path`).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"HYBRIDDL-CACHE2\n"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<QQ")  # the header's offset and length
ROW_ALIGN = 4096  # rows start on a page, so a read of one row touches the fewest pages
IMAGES_AT = ROW_ALIGN
RECORD = np.dtype([("label", "<i8"), ("crc", "<u4"), ("item", "<u4")])


def skipped_list_path(cache: Path) -> Path:
    return cache.with_name(cache.name + ".skipped.txt")


def encode_header(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True).encode()


def header_at(count: int, stored_size: int) -> int:
    return IMAGES_AT + count * 3 * stored_size ** 2 + count * RECORD.itemsize


def read_header(path: Path) -> dict | None:
    """The header of a complete cache file of this format, or None (not one, cut short,
    damaged, another format, an unfinished build)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(MAGIC)) != MAGIC:
                return None
            at, length = PREFIX.unpack(handle.read(PREFIX.size))
            size = os.fstat(handle.fileno()).st_size
            if not at or at + length != size:
                return None
            handle.seek(at)
            header = json.loads(handle.read(length))
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION \
                or header_at(header["count"], header["stored_size"]) != at:
            return None
        return header
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def read_records(path: Path, header: dict) -> np.ndarray | None:
    n = header["count"]
    at = header_at(n, header["stored_size"]) - n * RECORD.itemsize
    with open(path, "rb") as handle:
        handle.seek(at)
        raw = handle.read(n * RECORD.itemsize)
    if len(raw) != n * RECORD.itemsize or f"{zlib.crc32(raw):08x}" != header["tables_crc"]:
        return None
    return np.frombuffer(raw, dtype=RECORD)
