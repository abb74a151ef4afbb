"""The KServe v2 request body as it arrives: Content-Encoding, Triton's binary tensor extension,
and each input tensor's values checked against its declared datatype.

Kept apart from the routes (serving/kserve_api.py) because it is pure decoding: bytes and JSON in,
Python values out, every refusal a 400 (or 413 / 415) naming the field as the client sent it,
`inputs[<name>]`, never a field of some other API.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from fastapi import Request

from serving import errors
from serving.gateway import check_json_content_type, decode_json

# (struct code, size) of the numeric tensor types the binary extension carries
_NUMERIC = {"BOOL": ("?", 1), "INT8": ("b", 1), "INT16": ("h", 2), "INT32": ("i", 4), "INT64": ("q", 8),
            "UINT8": ("B", 1), "UINT16": ("H", 2), "UINT32": ("I", 4), "UINT64": ("Q", 8), "FP32": ("f", 4),
            "FP64": ("d", 8)}
_FP_MAX = {"FP32": 3.4028234663852886e38, "FP64": 1.7976931348623157e308}


def split_binary(request: Request, raw: bytes) -> tuple[dict, bytes]:
    """(JSON header, binary tensor data) of an /infer body."""
    header = request.headers.get("inference-header-content-length")
    if header is None:
        check_json_content_type(request)
        return decode_json(raw), b""
    try:
        size = int(header)
    except ValueError:
        raise errors.invalid("Inference-Header-Content-Length: not an integer", None, "invalid_header") from None
    if not 0 < size <= len(raw):
        raise errors.invalid(f"Inference-Header-Content-Length: {size} is outside the body of {len(raw)} bytes",
                             None, "invalid_header")
    return decode_json(raw[:size]), raw[size:]


def or_empty(value: Any, empty: Any) -> Any:
    """`empty` for an absent or null field, else the value as sent (false or 0 stay, to be refused)."""
    return empty if value is None else value


def _flatten(data: Any) -> list:
    if isinstance(data, list):
        out = []
        for x in data:
            out.extend(_flatten(x))
        return out
    return [data]


def _decode_bytes(buf: bytes, param: str) -> list[str]:
    out, i = [], 0
    while i < len(buf):
        if i + 4 > len(buf):
            raise errors.invalid(f"{param}: truncated BYTES tensor", param)
        (n,) = struct.unpack_from("<I", buf, i)
        i += 4
        if i + n > len(buf):
            raise errors.invalid(f"{param}: truncated BYTES tensor", param)
        out.append(_utf8(buf[i:i + n], param))
        i += n
    return out


def _utf8(b: Any, param: str) -> str:
    if isinstance(b, str):
        return b
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid(f"{param}: BYTES elements must be UTF-8 text", param) from None


def _check_typed(values: list, dtype: str, param: str) -> None:
    """Each value is one of `dtype`: JSON carries no types of its own, so ["false"] under BOOL
    (which bool() makes True) or 5000000000 under INT32 must be refused here, not coerced."""
    for v in values:
        if dtype == "BOOL":
            ok, want = isinstance(v, bool), "JSON true or false"
        elif dtype.startswith(("INT", "UINT")):
            bits = int(dtype.removeprefix("U").removeprefix("INT"))
            lo, hi = (0, 2 ** bits - 1) if dtype.startswith("U") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            ok, want = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, f"integers in [{lo}, {hi}]"
        else:  # FP32 / FP64: finite, and within the type (NaN and Infinity parse as JSON in Python)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and abs(v) <= _FP_MAX[dtype]
            want = f"finite numbers within {dtype}'s range"
        if not ok:
            raise errors.invalid(f"{param}: {dtype} data must be {want}, got {v!r}", param, "invalid_type")


def tensor_values(t: dict, i: int, blob: bytes, offset: int) -> tuple[str, list, list[int], int]:
    """(name, flat values, shape, new blob offset) of inputs[i]."""
    param = f"inputs[{i}]"
    if not isinstance(t, dict):
        raise errors.invalid(f"{param}: must be an object with name, shape, datatype and data", param)
    unknown = set(t) - {"name", "shape", "datatype", "data", "parameters"}
    if unknown:
        raise errors.invalid(f"{param}: unknown field(s) {', '.join(sorted(unknown))}", param, "unknown_parameter")
    name, shape, dtype = t.get("name"), t.get("shape"), t.get("datatype")
    if not isinstance(name, str):
        raise errors.invalid(f"{param}.name: must be a string", f"{param}.name", "invalid_type")
    param = f"inputs[{name}]"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise errors.invalid(f"{param}.shape: must be a list of non-negative integers", f"{param}.shape")
    if not isinstance(dtype, str) or (dtype != "BYTES" and dtype not in _NUMERIC):
        # a non-string (an object, a list) is refused by name too: it is not hashable, so the
        # membership test alone raised TypeError, a 500
        raise errors.invalid(f"{param}.datatype: {dtype!r} is not a tensor type; one of BYTES, "
                             f"{', '.join(_NUMERIC)}", f"{param}.datatype", "invalid_type")
    count = math.prod(shape)
    params = or_empty(t.get("parameters"), {})
    if not isinstance(params, dict):
        raise errors.invalid(f"{param}.parameters: must be an object", f"{param}.parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(blob):
            raise errors.invalid(f"{param}: binary_data_size {size!r} does not fit the binary body", param)
        buf = blob[offset:offset + size]
        offset += size
        if dtype == "BYTES":
            values: list = _decode_bytes(buf, param)
        else:
            code, width = _NUMERIC[dtype]
            if len(buf) != count * width:
                raise errors.invalid(f"{param}: {len(buf)} bytes do not hold {count} {dtype} values", param)
            values = list(struct.unpack(f"<{count}{code}", buf))
            if dtype in _FP_MAX:  # every bit pattern is a value, NaN and infinities included
                _check_typed(values, dtype, param)
    else:
        if "data" not in t:
            raise errors.invalid(f"{param}.data: missing (or give parameters.binary_data_size)", f"{param}.data",
                                 "missing_required_parameter")
        values = _flatten(t["data"])
        if dtype == "BYTES":
            values = [_utf8(v, param) if isinstance(v, str) else _bad_bytes(param) for v in values]
        else:
            _check_typed(values, dtype, param)
    if len(values) != count:
        raise errors.invalid(f"{param}: shape {shape} needs {count} values, got {len(values)}", param)
    return name, values, shape, offset


def _bad_bytes(param: str):
    raise errors.invalid(f"{param}: BYTES data must be strings", param, "invalid_type")


def scalar(name: str, values: list) -> Any:
    if len(values) != 1:
        raise errors.invalid(f"inputs[{name}]: a parameter tensor holds exactly one value, got {len(values)}",
                             f"inputs[{name}]")
    return values[0]
