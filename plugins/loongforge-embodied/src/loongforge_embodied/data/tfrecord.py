"""TFRecord files without TensorFlow: the record framing TFDS shards use, read with every checksum verified.

A TFRecord file is a sequence of records, each framed as::

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data[length] | uint32 masked_crc32c(data)

where ``masked_crc32c(x) = ((crc >> 15 | crc << 17) + 0xA282EAD8) mod 2**32`` of the CRC-32C (Castagnoli) of ``x``
(TensorFlow's ``core/lib/io/record_writer`` and ``core/lib/hash/crc32c``). Why verify both: a flipped bit in a length
makes every following record garbage, and one in the data makes a wrong image or action silently; either must stop
the read with one line naming the file and the record, not a protobuf traceback three layers down.

No CRC-32C package is installed with the plugin (``google-crc32c`` and ``crc32c`` are native extensions), so the
checksum is the standard reflected table-driven CRC-32C below: 256 precomputed remainders of the reversed
Castagnoli polynomial ``0x82F63B78``, one table lookup per byte. It is pure Python, a few MB/s: fine for checking
and converting small sets, the bottleneck on large ones. A shard is read whole before its records are checked
(TFDS shards of OXE sets are tens to hundreds of MB).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from loongforge.errors import LoongForgeError

#: The reversed Castagnoli polynomial (iSCSI, RFC 3720), as TensorFlow and TFDS use it.
_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def _table() -> tuple[int, ...]:
    """Remainder of each byte value after 8 shifts of the reflected CRC (the classic byte-wise table)."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _table()


class TFRecordError(LoongForgeError, ValueError):
    """A TFRecord file that cannot be read as intact records; the message names the file and the record."""


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (check value: ``crc32c(b"123456789") == 0xE3069283``)."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC TFRecord stores: rotated right by 15 bits plus a constant, so a CRC of CRCs is not trivially zero."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def read_records(path: str | Path) -> Iterator[bytes]:
    """Every record of the TFRecord file ``path`` in order, each checked against both of its CRCs; a
    :class:`TFRecordError` naming the file and record index on a bad checksum or a file cut short."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise TFRecordError(f"{path}: cannot read the TFRecord file: {err.strerror or err}") from None
    offset, index = 0, 0
    while offset < len(blob):
        where = f"{path}: record {index} (byte {offset})"
        if offset + _HEADER.size > len(blob):
            raise TFRecordError(f"{where}: the file ends inside the record header (truncated shard?)")
        length, length_crc = _HEADER.unpack_from(blob, offset)
        if masked_crc32c(blob[offset:offset + 8]) != length_crc:
            raise TFRecordError(f"{where}: the length's CRC does not match (corrupted file)")
        start = offset + _HEADER.size
        end = start + length
        if end + _FOOTER.size > len(blob):
            raise TFRecordError(f"{where}: the file ends inside the record's {length} bytes (truncated shard?)")
        data = blob[start:end]
        (data_crc,) = _FOOTER.unpack_from(blob, end)
        if masked_crc32c(data) != data_crc:
            raise TFRecordError(f"{where}: the data's CRC does not match (corrupted file)")
        yield data
        offset, index = end + _FOOTER.size, index + 1


def write_records(path: str | Path, records: Iterable[bytes]) -> Path:
    """Write ``records`` as a TFRecord file (framing and masked CRCs as TensorFlow writes them); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        for data in records:
            length = struct.pack("<Q", len(data))
            handle.write(length + _FOOTER.pack(masked_crc32c(length)) + data + _FOOTER.pack(masked_crc32c(data)))
    return path
