"""A bounds check of a GGUF file's header, run before the ``gguf`` reader (which believes every length it reads) is
trusted with it: :func:`scan` walks the header, key/value pairs and tensor infos with :mod:`struct`, checking each
declared length against the bytes left and each tensor's extent against the data section, and raises a
:class:`~kvexplore.errors.CorruptFileError` naming the key or tensor and the byte offset. It reads no tensor data."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from ..errors import CorruptFileError

# GGUF value types -> struct format of one element (8: string, 9: array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY = 1 << 16
MAX_DEPTH = 4


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, name: str, order: str) -> None:
        self.buf, self.name, self.order, self.size = buf, name, order, len(buf)

    def fail(self, at: int, what: str) -> CorruptFileError:
        return CorruptFileError(f"{self.name}: {what} (at byte {at} of {self.size}); the file is truncated or "
                                f"corrupt: download or convert it again")

    def unpack(self, fmt: str, at: int, what: str) -> tuple[int, ...]:
        n = struct.calcsize(fmt)
        if at + n > self.size:
            raise self.fail(at, f"{what} runs past the end of the file")
        return struct.unpack_from(self.order + fmt, self.buf, at)

    def string(self, at: int, what: str, limit: int | None = None) -> tuple[bytes, int]:
        (n,) = self.unpack("Q", at, f"the length of {what}")
        if n > self.size - at - 8 or (limit is not None and n > limit):
            raise self.fail(at, f"{what} claims {n} bytes, more than the file holds")
        return bytes(self.buf[at + 8:at + 8 + n]), at + 8 + n

    def value(self, value_type: int, at: int, key: str) -> tuple[object, int]:
        """The value (scalars and strings only; arrays are checked and skipped) and the offset after it."""
        if value_type in _SCALAR:
            fmt = _SCALAR[value_type]
            return self.unpack(fmt, at, f"the value of {key}")[0], at + struct.calcsize(fmt)
        if value_type == STRING:
            return self.string(at, f"the string value of {key}")
        if value_type == ARRAY:
            return self.array(at, key)
        raise self.fail(at, f"metadata {key} has unknown value type {value_type}")

    def array(self, at: int, key: str, depth: int = 0) -> tuple[object, int]:
        """Check an array's declared size against the bytes left, walk its strings and sub-arrays, skip it."""
        if depth >= MAX_DEPTH:
            raise self.fail(at, f"{key} nests arrays more than {MAX_DEPTH} deep")
        sub, count = self.unpack("IQ", at, f"the array header of {key}")
        at += 12
        left = self.size - at
        if sub in _SCALAR:
            width = struct.calcsize(_SCALAR[sub])
            if count > left // width:
                raise self.fail(at, f"array {key} claims {count} elements of {width} bytes, more than the "
                                    f"{left} bytes left in the file")
            return None, at + count * width
        if sub not in (STRING, ARRAY):
            raise self.fail(at, f"array {key} has unknown element type {sub}")
        if count > left // (8 if sub == STRING else 12):  # the smallest string or array there can be
            raise self.fail(at, f"array {key} claims {count} elements, more than the {left} bytes left can hold")
        for i in range(count):
            if sub == STRING:
                (n,) = self.unpack("Q", at, f"element {i} of {key}")
                if n > self.size - at - 8:
                    raise self.fail(at, f"element {i} of {key} claims {n} bytes, more than the file holds")
                at += 8 + n
            else:
                _, at = self.array(at, f"{key}[{i}]", depth + 1)
        return None, at


def scan(path: str | Path) -> None:
    """Raise a CorruptFileError if any declared length or tensor extent in ``path`` does not fit the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise CorruptFileError(f"{path.name}: {size} bytes is too short for a GGUF header (24 bytes); the file "
                                   f"is truncated: download it again")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise CorruptFileError(f"{path.name}: not a GGUF file (it starts with {bytes(buf[:4])!r}, not "
                                       f"b'GGUF'); give a .gguf model file")
            (version,) = struct.unpack_from("<I", buf, 4)
            order = "<" if version & 0xFFFF else ">"
            r = _Reader(buf, path.name, order)
            version, n_tensors, n_kv = r.unpack("IQQ", 4, "the header")
            if version not in (2, 3):
                raise r.fail(4, f"GGUF version {version} is not 2 or 3")
            at = 24
            if n_kv > (size - at) // 12 or n_tensors > (size - at) // 28:
                raise r.fail(8, f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than "
                                f"the file can hold")
            alignment = 32
            for _ in range(n_kv):
                raw_key, at = r.string(at, "a metadata key", MAX_KEY)
                key = raw_key.decode("utf-8", "replace")
                (value_type,) = r.unpack("I", at, f"the type of {key}")
                value, at = r.value(value_type, at + 4, key)
                if key == "general.alignment":
                    if not isinstance(value, int) or value < 1 or value & (value - 1):
                        raise r.fail(at, f"general.alignment is {value!r}, not a power of two")
                    alignment = value
            extents = []
            for _ in range(n_tensors):
                raw_name, at = r.string(at, "a tensor name", MAX_KEY)
                name = raw_name.decode("utf-8", "replace")
                (n_dims,) = r.unpack("I", at, f"the dimension count of tensor {name}")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise r.fail(at, f"tensor {name} has {n_dims} dimensions (GGUF allows 1..{MAX_DIMS})")
                dims = r.unpack("Q" * n_dims, at + 4, f"the shape of tensor {name}")
                ggml_type, offset = r.unpack("IQ", at + 4 + 8 * n_dims, f"the type and offset of tensor {name}")
                at += 4 + 8 * n_dims + 12
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
                except (ValueError, KeyError):
                    raise r.fail(at, f"tensor {name} has unknown ggml type {ggml_type}") from None
                count = math.prod(dims)
                if count == 0 or count % block or dims[0] % block:
                    raise r.fail(at, f"tensor {name} has shape {list(dims)}, which ggml type {ggml_type} cannot hold "
                                     f"(blocks of {block} elements)")
                extents.append((name, offset, count // block * type_size))
            data = (at + alignment - 1) // alignment * alignment
            for name, offset, nbytes in extents:
                if data + offset + nbytes > size:
                    raise r.fail(data + offset, f"tensor {name} needs bytes {data + offset}..{data + offset + nbytes}"
                                                f", past the end of the file")
