"""A small Thrift compact-protocol codec, to rewrite Parquet footers in tests.

A struct decodes to a list of ``[field_id, type, value]`` (in file order, so an encoded
struct is byte-identical to the original); lists and sets to ``(elem_type, [values])``,
maps to ``(key_type, value_type, [(k, v)])``.  Only what Parquet's ``FileMetaData`` uses.
"""

from __future__ import annotations

import struct
from typing import Any

BOOL_TRUE, BOOL_FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        b = self.data[self.at]
        self.at += 1
        return b

    def varint(self) -> int:
        shift = out = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, t: int) -> Any:
        if t in (BOOL_TRUE, BOOL_FALSE):  # inside a list: one byte each
            return self.byte() == 1
        if t == BYTE:
            return self.byte()
        if t in (I16, I32, I64):
            return self.zigzag()
        if t == DOUBLE:
            self.at += 8
            return struct.unpack("<d", self.data[self.at - 8 : self.at])[0]
        if t == BINARY:
            n = self.varint()
            self.at += n
            return self.data[self.at - n : self.at]
        if t in (LIST, SET):
            h = self.byte()
            n, et = h >> 4, h & 0x0F
            if n == 15:
                n = self.varint()
            return (et, [self.value(et) for _ in range(n)])
        if t == MAP:
            n = self.varint()
            if not n:
                return (0, 0, [])
            kv = self.byte()
            kt, vt = kv >> 4, kv & 0x0F
            return (kt, vt, [(self.value(kt), self.value(vt)) for _ in range(n)])
        if t == STRUCT:
            return self.struct()
        raise ValueError(f"thrift type {t}")

    def struct(self) -> list[list[Any]]:
        fields: list[list[Any]] = []
        last = 0
        while True:
            h = self.byte()
            if h == 0:
                return fields
            delta, t = h >> 4, h & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            if t in (BOOL_TRUE, BOOL_FALSE):
                fields.append([fid, t, t == BOOL_TRUE])
            else:
                fields.append([fid, t, self.value(t)])


def decode(data: bytes) -> list[list[Any]]:
    """The top-level struct of ``data`` (a Parquet footer: ``FileMetaData``)."""
    return _Reader(data).struct()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63) if n >= 0 else ((-n - 1) << 1) | 1)


def _value(t: int, v: Any) -> bytes:
    if t in (BOOL_TRUE, BOOL_FALSE):
        return b"\x01" if v else b"\x02"
    if t == BYTE:
        return bytes([v & 0xFF])
    if t in (I16, I32, I64):
        return _zigzag(v)
    if t == DOUBLE:
        return struct.pack("<d", v)
    if t == BINARY:
        return _varint(len(v)) + bytes(v)
    if t in (LIST, SET):
        et, items = v
        head = (
            bytes([(len(items) << 4) | et])
            if len(items) < 15
            else bytes([0xF0 | et]) + _varint(len(items))
        )
        return head + b"".join(_value(et, x) for x in items)
    if t == MAP:
        kt, vt, items = v
        if not items:
            return b"\x00"
        return (
            _varint(len(items))
            + bytes([(kt << 4) | vt])
            + b"".join(_value(kt, k) + _value(vt, x) for k, x in items)
        )
    if t == STRUCT:
        return encode(v)
    raise ValueError(f"thrift type {t}")


def encode(fields: list[list[Any]]) -> bytes:
    out = bytearray()
    last = 0
    for fid, t, v in fields:
        wire = (BOOL_TRUE if v else BOOL_FALSE) if t in (BOOL_TRUE, BOOL_FALSE) else t
        if 0 < fid - last <= 15:
            out.append(((fid - last) << 4) | wire)
        else:
            out.append(wire)
            out += _zigzag(fid)
        last = fid
        if t not in (BOOL_TRUE, BOOL_FALSE):
            out += _value(t, v)
    out.append(0)
    return bytes(out)


def field(fields: list[list[Any]], fid: int) -> list[Any]:
    """The ``[id, type, value]`` entry of field ``fid``."""
    return next(f for f in fields if f[0] == fid)


def split_parquet(data: bytes) -> tuple[bytes, list[list[Any]]]:
    """A Parquet file's bytes before its footer, and its decoded footer."""
    n = struct.unpack("<I", data[-8:-4])[0]
    return data[: len(data) - 8 - n], decode(data[len(data) - 8 - n : -8])


def join_parquet(body: bytes, footer: list[list[Any]]) -> bytes:
    raw = encode(footer)
    return body + raw + struct.pack("<I", len(raw)) + b"PAR1"
