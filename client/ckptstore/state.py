"""Nested training state <-> named tensors plus a tagged-JSON skeleton.

``flatten`` walks a nested state (model, optimizer and scheduler ``state_dict``s, RNG states,
counters) and splits it in two: the tensors, each under a name derived from its key path, and a
*skeleton* -- compact JSON of everything else, with a reference where each tensor sat.
``unflatten`` inverts it exactly: container types (dict, ``OrderedDict``, ``Counter``, list,
tuple), key
order, key types (optimizer state keys stay ``int``; ``True`` stays ``bool``), and every leaf
value bit for bit. No pickle is involved (docs/architecture.md, invariant 4).

Tensor names
    The key path joined with ``/``; each component is ``str(key)`` (or the list index) escaped
    JSON-Pointer style (``~`` -> ``~0``, ``/`` -> ``~1``, and NUL, which PostgreSQL text cannot
    hold, -> ``~z``), so ``{"optimizer": {"state": {0: {"exp_avg": t}}}}`` names ``t``
    ``optimizer/state/0/exp_avg``. When two paths render to the same name (keys ``0`` and
    ``"0"`` in one dict) the later one in traversal order gets ``~2``, ``~3``, ... appended --
    text escaping never produces. The names safetensors cannot carry count as taken from the
    start: ``""`` (a tensor at the root, or under the root key ``""``) is sent as ``~2``, and
    ``__metadata__`` as ``__metadata__~2``. A tensor reached from several paths
    (tied weights: same storage, offset, shape, stride and dtype) is named and sent once; every
    path refers to that one name and ``unflatten`` puts the same tensor object at each of them.

Skeleton (version 1)
    ``{"v":1,"root":NODE}``. A NODE is plain JSON where that is unambiguous -- string, ``true``,
    ``false``, ``null``, an integer of at most 2**53 in magnitude, a finite float (always written
    with ``.`` or ``e``, so it never reads back as an int), an array for a ``list`` -- and
    otherwise an object tagged by ``"t"``:

    ``{"t":"tuple","v":[NODE...]}``
    ``{"t":"dict","v":[[KEY,NODE]...]}``  (KEY: a str/int/float/bool/None NODE)
    ``{"t":"odict","v":[[KEY,NODE]...],"m":NODE}``  (``OrderedDict``; ``m``: its ``_metadata``,
    the per-module versions ``nn.Module.state_dict`` attaches; absent when there is none)
    ``{"t":"counter","v":[[KEY,NODE]...]}``  (``collections.Counter``, e.g. the milestones of
    ``MultiStepLR``)
    ``{"t":"tensor","n":NAME}``
    ``{"t":"int","v":"-0x1f..."}``  (beyond 2**53; hex because decimal conversion is capped)
    ``{"t":"float","v":"7ff8000000000000"}``  (nan/inf: the IEEE-754 binary64 bits, big-endian)
    ``{"t":"bytes","v":BASE64}``
    ``{"t":"size","v":[int...]}``  (``torch.Size``)
    ``{"t":"dtype","v":"bfloat16"}``  (``torch.dtype``, names from an explicit table)
    ``{"t":"ndarray","d":"<u4","s":[624],"v":BASE64}``  (numeric/bool numpy array, C order)
    ``{"t":"ndarray","d":"<f4","s":[...],"n":NAME}``  (a large one, sent as the tensor NAME)
    ``{"t":"npscalar","d":"<f8","v":BASE64}``  (``np.float64(...)``, ``np.bool_(...)``, ...)

Tensors themselves travel as raw little-endian bytes under the safetensors dtype codes of
:func:`dtype_to_wire`; :func:`tensor_bytes` and :func:`tensor_from_bytes` are the two ends.

This is the one client module that needs torch; ``import ckptstore`` must not import it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import numpy as np
import torch

__all__ = [
    "flatten",
    "upload_order",
    "unflatten",
    "referenced_tensors",
    "dtype_to_wire",
    "dtype_from_wire",
    "tensor_bytes",
    "tensor_from_bytes",
    "FlatState",
    "DTYPE_TO_NAME",
    "NAME_TO_DTYPE",
    "param_names",
]

SKELETON_VERSION: Final = 1

# safetensors dtype codes. Explicit: str(dtype) is not a stable format.
_TO_WIRE: Final[dict[torch.dtype, str]] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_WIRE: Final[dict[str, torch.dtype]] = {code: dt for dt, code in _TO_WIRE.items()}

# Names for torch.dtype *values* in the skeleton (a config may hold one). Looked up by
# attribute so that dtypes missing from an older torch are simply absent.
_DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
)
DTYPE_TO_NAME: Final[dict[torch.dtype, str]] = {
    getattr(torch, n): n for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
NAME_TO_DTYPE: Final[dict[str, torch.dtype]] = {n: dt for dt, n in DTYPE_TO_NAME.items()}

# numpy dtypes that can ride as a tensor, by numpy's dtype.str (native little-endian only).
_NUMPY_TO_TORCH: Final[dict[str, torch.dtype]] = {
    "|b1": torch.bool,
    "|u1": torch.uint8,
    "|i1": torch.int8,
    "<i2": torch.int16,
    "<i4": torch.int32,
    "<i8": torch.int64,
    "<u2": torch.uint16,
    "<u4": torch.uint32,
    "<u8": torch.uint64,
    "<f2": torch.float16,
    "<f4": torch.float32,
    "<f8": torch.float64,
}
_NUMPY_KINDS: Final = frozenset("biufc")  # bool, int, uint, float, complex

# Arrays above this size go as tensors, so the header stays small and the body streams.
_NDARRAY_INLINE_MAX: Final = 64 * 1024
# Integers above this magnitude are written as hex: JSON readers in other languages lose
# precision past 2**53, and Python caps decimal int<->str conversion at 4300 digits.
_JSON_INT_MAX: Final = 2**53
# Int keys up to this size render in decimal in tensor names, bigger ones in hex.
_DECIMAL_KEY_MAX: Final = 10**1000

_KeyType = str | int | float | bool | None


@dataclass(frozen=True)
class FlatState:
    """The result of :func:`flatten`.

    ``tensors`` lists each distinct tensor once, in traversal order, as ``(name, tensor)``. The
    tensors are the caller's own (detached, not copied, possibly still on an accelerator):
    turn them into bytes one at a time with :func:`tensor_bytes` so memory stays bounded.
    ``skeleton`` is the tagged JSON of everything else (see the module docstring).
    """

    tensors: list[tuple[str, torch.Tensor]]
    skeleton: str


# --------------------------------------------------------------------------- dtypes and bytes


def dtype_to_wire(dtype: torch.dtype) -> str:
    """The safetensors code of a tensor dtype; ``TypeError`` for a dtype with none."""
    try:
        return _TO_WIRE[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"dtype {dtype} has no wire code") from None


def dtype_from_wire(code: str) -> torch.dtype:
    """The tensor dtype of a safetensors code; ``ValueError`` for an unknown code."""
    try:
        return _FROM_WIRE[code]
    except (KeyError, TypeError):
        raise ValueError(f"unknown wire dtype {code!r}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` as a flat ``"B"`` memoryview.

    Zero-copy for a contiguous CPU tensor (the view keeps the tensor alive and follows later
    in-place writes to it); otherwise one copy (device to host, or making it contiguous).
    """
    t = t.detach().cpu().contiguous().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return memoryview(b"")
    # A flat uint8 view exists for every dtype, including the ones numpy lacks (bf16, fp8).
    # as_strided, not reshape: a contiguous tensor may still carry odd strides on size-1
    # dims, which reshape keeps and view(uint8) rejects.
    raw = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size())[:, ::-1].copy().reshape(-1)
    return raw.data


def tensor_from_bytes(
    buf: bytearray | memoryview | bytes, dtype_code: str, shape: Sequence[int]
) -> torch.Tensor:
    """Build a tensor from its wire bytes.

    A writable buffer (``bytearray``, writable ``memoryview``) whose address suits the dtype's
    alignment is used in place: the tensor shares its memory. ``bytes``, read-only or misaligned
    buffers are copied once. ``ValueError`` for an unknown code, a bad shape, or a byte count
    that does not match the shape.
    """
    dtype = dtype_from_wire(dtype_code)
    dims = _check_shape(shape)
    view = memoryview(buf)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    itemsize = dtype.itemsize
    numel = math.prod(dims)
    if view.nbytes != numel * itemsize:
        raise ValueError(
            f"{view.nbytes} bytes do not hold a {dtype_code} tensor of shape {list(dims)}"
        )
    if numel == 0:
        return torch.empty(dims, dtype=dtype)
    if view.readonly or np.frombuffer(view, dtype=np.uint8).ctypes.data % itemsize:
        view = memoryview(bytearray(view))
    flat = torch.frombuffer(view, dtype=torch.uint8)
    if sys.byteorder != "little" and itemsize > 1:
        flat = flat.reshape(-1, itemsize).flip(1).reshape(-1)
    return flat.view(dtype).reshape(dims)


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    if not all(type(d) is int and d >= 0 for d in dims):
        raise ValueError(f"bad tensor shape {shape!r}")
    return dims


# --------------------------------------------------------------------------------- flatten


def _escape(component: str) -> str:
    return component.replace("~", "~0").replace("/", "~1").replace("\x00", "~z")


def _join(path: str, component: object, *, root: bool) -> str:
    if type(component) is int and abs(component) >= _DECIMAL_KEY_MAX:
        # Decimal conversion of huge ints is capped by the interpreter (sys.int_info).
        text = hex(component)
    else:
        text = str(component)
    escaped = _escape(text)
    return escaped if root else f"{path}/{escaped}"


def _show(path: str) -> str:
    return f"'{path}'" if path else "the root"


class _Flattener:
    def __init__(self, *, allow_tensors: bool = True) -> None:
        self._allow_tensors = allow_tensors
        self.tensors: list[tuple[str, torch.Tensor]] = []
        # taken from the start: safetensors has no tensor named "" or "__metadata__"
        self._names: set[str] = {"", "__metadata__"}
        self._by_identity: dict[tuple[object, ...], str] = {}
        self._keepalive: list[object] = []  # keeps id()-based identity keys valid
        self._active: set[int] = set()  # containers on the current path (cycle check)

    def _allocate(self, path: str) -> str:
        name, n = path, 1
        while name in self._names:
            n += 1
            name = f"{path}~{n}"
        self._names.add(name)
        return name

    def node(self, value: object, path: str, *, root: bool = False) -> object:
        # Exact type checks throughout: bool is an int, np.float64 is a float, torch.Size is
        # a tuple, and a subclass we do not know cannot be rebuilt.
        if value is None or type(value) is str or type(value) is bool:
            return value
        if type(value) is int:
            return _encode_int(value)
        if type(value) is float:
            return _encode_float(value)
        if isinstance(value, torch.Tensor):
            if not self._allow_tensors:
                raise TypeError(f"unexpected tensor at {_show(path)}")
            return {"t": "tensor", "n": self._tensor(value, path)}
        if type(value) is dict or type(value) is OrderedDict or type(value) is Counter:
            return self._mapping(value, path, root=root)
        if type(value) is list or type(value) is tuple:
            return self._sequence(value, path, root=root)
        if type(value) is bytes:
            return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
        if type(value) is torch.Size:
            return {"t": "size", "v": list(value)}
        if type(value) is torch.dtype:
            name = DTYPE_TO_NAME.get(value)
            if name is None:
                raise TypeError(f"unsupported dtype {value} at {_show(path)}")
            return {"t": "dtype", "v": name}
        if type(value) is np.ndarray:
            return self._ndarray(value, path)
        if isinstance(value, np.generic):
            return _encode_npscalar(value, path)
        raise TypeError(f"unsupported type {type(value).__qualname__} at {_show(path)}")

    def _enter(self, value: object, path: str) -> None:
        if id(value) in self._active:
            raise ValueError(f"reference cycle at {_show(path)}")
        self._active.add(id(value))

    def _mapping(self, value: Mapping[object, object], path: str, *, root: bool) -> object:
        self._enter(value, path)
        items = []
        for key, item in value.items():
            if not (key is None or type(key) in (str, int, float, bool)):
                raise TypeError(
                    f"unsupported key type {type(key).__qualname__} ({key!r}) in the mapping "
                    f"at {_show(path)}"
                )
            child = _join(path, key, root=root)
            items.append([self.node(key, child), self.node(item, child)])
        self._active.discard(id(value))
        if type(value) is dict:
            return {"t": "dict", "v": items}
        if type(value) is Counter:
            return {"t": "counter", "v": items}
        out: dict[str, object] = {"t": "odict", "v": items}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            # Module versions (plain dicts of ints), not state: no tensors allowed here.
            out["m"] = _Flattener(allow_tensors=False).node(metadata, f"{path}(_metadata)")
        return out

    def _sequence(
        self, value: list[object] | tuple[object, ...], path: str, *, root: bool
    ) -> object:
        self._enter(value, path)
        items = [self.node(item, _join(path, i, root=root)) for i, item in enumerate(value)]
        self._active.discard(id(value))
        return items if type(value) is list else {"t": "tuple", "v": items}

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            what = "quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
            raise TypeError(f"unsupported {what} tensor at {_show(path)}")
        if t.device.type == "meta":
            raise TypeError(f"meta tensor (no data) at {_show(path)}")
        if t.dtype not in _TO_WIRE:
            raise TypeError(f"unsupported tensor dtype {t.dtype} at {_show(path)}")
        original, t = t, t.detach()
        # No bytes to compare by: only the very same object counts as tied.
        identity = _identity(t) or ("object", id(original))
        self._keepalive.append(original)
        name = self._by_identity.get(identity)
        if name is None:
            name = self._allocate(path)
            self._by_identity[identity] = name
            self.tensors.append((name, t))
        return name

    def _ndarray(self, a: np.ndarray[Any, np.dtype[Any]], path: str) -> object:
        if a.dtype.kind not in _NUMPY_KINDS or a.dtype.fields is not None:
            raise TypeError(f"unsupported numpy dtype {a.dtype} at {_show(path)}")
        dt = a.dtype.str
        shape = list(a.shape)
        if a.nbytes > _NDARRAY_INLINE_MAX and dt in _NUMPY_TO_TORCH:
            c = np.ascontiguousarray(a)
            # torch.from_numpy wants a writable array; it shares memory, like tensors do.
            t = torch.from_numpy(c if c.flags.writeable else c.copy())
            name = self._allocate(path)
            self.tensors.append((name, t))
            return {"t": "ndarray", "d": dt, "s": shape, "n": name}
        data = np.ascontiguousarray(a).tobytes()
        return {"t": "ndarray", "d": dt, "s": shape, "v": base64.b64encode(data).decode("ascii")}


def _encode_int(value: int) -> object:
    if -_JSON_INT_MAX <= value <= _JSON_INT_MAX:
        return value
    return {"t": "int", "v": hex(value)}


def _encode_float(value: float) -> object:
    if math.isfinite(value):
        return value  # json writes repr(): exact, and always with "." or "e"
    return {"t": "float", "v": struct.pack(">d", value).hex()}


def _encode_npscalar(value: np.generic, path: str) -> object:
    dt = value.dtype
    if dt.kind not in _NUMPY_KINDS or np.dtype(dt.str).type is not type(value):
        # e.g. np.longlong: same bytes as np.int64 but a different type we could not restore.
        raise TypeError(f"unsupported numpy scalar {type(value).__qualname__} at {_show(path)}")
    data = np.asarray(value).tobytes()
    return {"t": "npscalar", "d": dt.str, "v": base64.b64encode(data).decode("ascii")}


def flatten(state: object) -> FlatState:
    """Split ``state`` into named tensors and the skeleton of everything else.

    ``TypeError`` (naming the key path) for a value or key the skeleton cannot represent
    exactly: sets, complex numbers, arbitrary objects, subclasses of the supported types,
    sparse/quantized/nested/meta tensors, tensor dtypes without a wire code. ``ValueError``
    for a container that contains itself.

    Tensor subclasses (``nn.Parameter``) are flattened as their data and come back as plain
    tensors; ``requires_grad`` is not kept. A container reached twice is written twice: only
    tensors keep their sharing.
    """
    flattener = _Flattener()
    try:
        root = flattener.node(state, "", root=True)
        skeleton = json.dumps(
            {"v": SKELETON_VERSION, "root": root}, separators=(",", ":"), allow_nan=False
        )
    except RecursionError:
        raise ValueError(
            "state is nested too deeply: containers more than a few hundred levels deep "
            "(Python's recursion limit) cannot be flattened"
        ) from None
    return FlatState(tensors=flattener.tensors, skeleton=skeleton)


def upload_order(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The order a save streams ``tensors`` in (free: the skeleton names them).

    Wider dtypes first: the service predicts a bf16 copy from its fp32 master only once the
    master has arrived. Within a width, larger tensors first: the service encodes chunks under
    64 KiB in the thread that parses the upload, and with them at the end that work overlaps
    the codec threads' last large chunks instead of stalling the stream in between (fine-tune
    saves of bench/: 10% shorter on average over 7 interleaved pairs, each pair shorter).
    Ties keep the state's order.
    """
    return sorted(tensors, key=lambda nt: (-nt[1].element_size(), -nt[1].numel()))


# ------------------------------------------------------------------------------- unflatten


class _Drop:
    """Marks a node pruned away by ``prefix``."""


_DROP: Final = _Drop()


def _bad(msg: str, path: str) -> NoReturn:
    raise ValueError(f"malformed skeleton at {_show(path)}: {msg}")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"malformed skeleton: {name} is not JSON")


def _parse(skeleton: str) -> object:
    if not isinstance(skeleton, str | bytes | bytearray):
        raise ValueError(f"skeleton must be JSON text, not {type(skeleton).__qualname__}")
    try:
        doc = json.loads(skeleton, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("malformed skeleton: nested too deeply") from None
    if not isinstance(doc, dict) or set(doc) != {"v", "root"}:
        raise ValueError('malformed skeleton: expected {"v": ..., "root": ...}')
    if type(doc["v"]) is not int or doc["v"] != SKELETON_VERSION:
        raise ValueError(f"unsupported skeleton version {doc['v']!r}")
    return doc["root"]


def _fields(
    node: dict[str, Any], path: str, required: set[str], optional: frozenset[str] = frozenset()
) -> None:
    keys = set(node)
    if not required <= keys or not keys <= required | optional:
        _bad(f"tag {node.get('t')!r} wants fields {sorted(required)}, got {sorted(keys)}", path)


def _b64(value: object, path: str) -> bytes:
    if not isinstance(value, str):
        _bad("expected base64 text", path)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        _bad("bad base64", path)


def _numpy_dtype(value: object, path: str) -> np.dtype[Any]:
    if not isinstance(value, str):
        _bad("expected a numpy dtype string", path)
    try:
        dt = np.dtype(value)
    except TypeError:
        _bad(f"bad numpy dtype {value!r}", path)
    if dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.str != value:
        _bad(f"unsupported numpy dtype {value!r}", path)
    return dt


def _decode_shape(value: object, path: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        _bad("expected a shape", path)
    try:
        return _check_shape(value)
    except ValueError:
        _bad(f"bad shape {value!r}", path)


class _Unflattener:
    """Decodes a skeleton; with ``record`` set it only notes the tensor names it would use."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        prefix: str | None,
        record: dict[str, None] | None = None,
    ) -> None:
        self._tensors = tensors
        self._prefix = prefix
        self._record = record

    def _lookup(self, name: object, path: str) -> torch.Tensor | None:
        if not isinstance(name, str):
            _bad("tensor name must be a string", path)
        if self._record is not None:
            self._record[name] = None
            return None
        try:
            t = self._tensors[name]
        except KeyError:
            if self._prefix is not None and not name.startswith(self._prefix):
                raise KeyError(
                    f"tensor {name!r}, tied to {_show(path)}, lies outside prefix "
                    f"{self._prefix!r}: fetch the names from referenced_tensors() instead"
                ) from None
            raise KeyError(f"tensor {name!r} (at {_show(path)}) is missing") from None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] is a {type(t).__qualname__}, not a tensor")
        return t

    def node(self, node: object, path: str, inside: bool, *, root: bool = False) -> object:
        """Decode ``node`` at ``path``; ``inside``: ``path`` already lies within the prefix."""
        if not inside and self._prefix is not None and path.startswith(self._prefix):
            inside = True
        if node is None or type(node) in (str, bool, int, float):
            return node if inside else _DROP
        if type(node) is list:
            return self._sequence(node, path, inside, root=root, as_tuple=False)
        if type(node) is not dict:
            _bad(f"unexpected JSON value {node!r}", path)
        tag = node.get("t")
        if tag == "tuple":
            _fields(node, path, {"t", "v"})
            if type(node["v"]) is not list:
                _bad("tuple items must be an array", path)
            return self._sequence(node["v"], path, inside, root=root, as_tuple=True)
        if tag in ("dict", "odict", "counter"):
            return self._mapping(node, path, inside, root=root)
        if not inside:
            return _DROP
        return self._leaf(node, tag, path)

    def _leaf(self, node: dict[str, Any], tag: object, path: str) -> object:
        value = node.get("v")
        if tag == "tensor":
            _fields(node, path, {"t", "n"})
            return self._lookup(node["n"], path)
        if tag in ("int", "float", "bytes", "size", "dtype"):
            _fields(node, path, {"t", "v"})
        if tag == "int":
            if not isinstance(value, str):
                _bad("int value must be a hex string", path)
            try:
                return int(value, 16)
            except ValueError:
                _bad(f"bad int {value!r}", path)
        if tag == "float":
            try:
                if not isinstance(value, str) or len(value) != 16:
                    raise ValueError
                f: float = struct.unpack(">d", bytes.fromhex(value))[0]
                return f
            except ValueError:
                _bad(f"bad float bits {value!r}", path)
        if tag == "bytes":
            return _b64(value, path)
        if tag == "size":
            return torch.Size(_decode_shape(value, path))
        if tag == "dtype":
            if not isinstance(value, str) or value not in NAME_TO_DTYPE:
                _bad(f"unknown dtype name {value!r}", path)
            return NAME_TO_DTYPE[value]
        if tag == "ndarray":
            return self._ndarray(node, path)
        if tag == "npscalar":
            _fields(node, path, {"t", "d", "v"})
            dt = _numpy_dtype(node["d"], path)
            data = _b64(value, path)
            if len(data) != dt.itemsize:
                _bad("numpy scalar size does not match its dtype", path)
            return np.frombuffer(data, dtype=dt)[0]
        _bad(f"unknown tag {tag!r}", path)

    def _ndarray(self, node: dict[str, Any], path: str) -> np.ndarray[Any, np.dtype[Any]]:
        _fields(node, path, {"t", "d", "s"}, frozenset({"v", "n"}))
        if ("v" in node) == ("n" in node):
            _bad("an ndarray has exactly one of 'v' and 'n'", path)
        dt = _numpy_dtype(node["d"], path)
        shape = _decode_shape(node["s"], path)
        if "n" in node:
            t = self._lookup(node["n"], path)
            if t is None:  # recording
                return np.empty(0)
            if _NUMPY_TO_TORCH.get(dt.str) != t.dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"tensor {node['n']!r} is {t.dtype}{list(t.shape)}, but the skeleton wants "
                    f"a numpy {dt.str}{list(shape)} array at {_show(path)}"
                )
            return t.detach().cpu().numpy()
        data = _b64(node["v"], path)
        if len(data) != math.prod(shape) * dt.itemsize:
            _bad("ndarray byte count does not match its shape", path)
        # bytearray: a writable array, like the one that was saved.
        return np.frombuffer(bytearray(data), dtype=dt).reshape(shape)

    def _sequence(
        self, items: list[Any], path: str, inside: bool, *, root: bool, as_tuple: bool
    ) -> object:
        out = []
        for i, item in enumerate(items):
            value = self.node(item, _join(path, i, root=root), inside)
            if value is not _DROP:
                out.append(value)
        if not inside and not out:
            return _DROP
        return tuple(out) if as_tuple else out

    def _mapping(self, node: dict[str, Any], path: str, inside: bool, *, root: bool) -> object:
        ordered = node["t"] == "odict"
        counter = node["t"] == "counter"
        _fields(node, path, {"t", "v"}, frozenset({"m"}) if ordered else frozenset())
        pairs = node["v"]
        if type(pairs) is not list:
            _bad("mapping items must be an array", path)
        out: dict[Any, Any] = OrderedDict() if ordered else Counter() if counter else {}
        seen: set[object] = set()
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2:
                _bad("mapping items must be [key, value] pairs", path)
            key = self._key(pair[0], path)
            if key in seen:
                _bad(f"duplicate key {key!r}", path)
            seen.add(key)
            value = self.node(pair[1], _join(path, key, root=root), inside)
            if value is not _DROP:
                out[key] = value
        if not inside and not out:
            return _DROP
        if "m" in node:
            # Metadata is never pruned: it belongs to the mapping, not to a key path.
            out._metadata = _Unflattener({}, None).node(node["m"], f"{path}(_metadata)", True)  # type: ignore[attr-defined]
        return out

    def _key(self, node: object, path: str) -> _KeyType:
        if node is None or isinstance(node, str | bool | int | float):
            return node  # json.loads yields exactly these types, never subclasses
        if type(node) is dict and node.get("t") in ("int", "float"):
            key = self._leaf(node, node["t"], path)
            if isinstance(key, int | float):
                return key
        _bad(f"unsupported mapping key {node!r}", path)


def unflatten(skeleton: str, tensors: Mapping[str, torch.Tensor], prefix: str | None = None) -> Any:
    """Rebuild the state that :func:`flatten` produced ``skeleton`` from.

    ``tensors`` maps names to tensors (what the wire carried); the same tensor object lands at
    every path that referenced its name, so tied weights stay tied. Names it holds that the
    skeleton does not reference are ignored.

    With ``prefix``, only nodes whose rendered key path starts with ``prefix`` are returned,
    with their ancestors: ``prefix="model/"`` gives ``{"model": {...}}``. Containers that end up
    empty outside the prefix are dropped, so list indices outside it can shift; if nothing
    matches, the root comes back as an empty container. ``tensors`` then only needs the names
    :func:`referenced_tensors` lists for that prefix.

    ``ValueError`` for a malformed skeleton; ``KeyError`` for a referenced tensor that is not
    in ``tensors``.
    """
    root = _parse(skeleton)
    try:
        out = _Unflattener(tensors, prefix).node(root, "", prefix is None, root=True)
    except RecursionError:
        raise ValueError("malformed skeleton: nested too deeply") from None
    if out is _DROP:
        return _empty_like(root)
    return out


def _empty_like(root: object) -> object:
    """What a fully pruned root becomes: an empty container of its kind, else None."""
    if type(root) is list:
        return []
    tag = root.get("t") if type(root) is dict else None
    if tag == "tuple":
        return ()
    if tag == "dict":
        return {}
    if tag == "odict":
        return OrderedDict()
    if tag == "counter":
        return Counter()
    return None


def referenced_tensors(skeleton: str, prefix: str | None = None) -> list[str]:
    """The tensor names ``unflatten(skeleton, ..., prefix)`` will look up, in first-use order.

    With a prefix this can include names outside it: a tensor tied to one under the prefix
    travels under the name of its first occurrence. ``ValueError`` for a malformed skeleton.
    """
    names: dict[str, None] = {}
    root = _parse(skeleton)
    try:
        _Unflattener({}, prefix, names).node(root, "", prefix is None, root=True)
    except RecursionError:
        raise ValueError("malformed skeleton: nested too deeply") from None
    return list(names)


# ------------------------------------------------------------------------ parameter names


def param_names(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    flat: FlatState | None = None,
) -> str | None:
    """What a save says about its state's parameters (``ckptstore.param_names``, the JSON of
    :class:`ckptstore_core.lossy.ParamNames`), from the live objects: per optimizer, per
    param group, the ``model.named_parameters()`` name of each parameter, in the order whose
    positions ``optimizer.state_dict()`` numbers as its integer ids (group after group), by
    identity: exact whatever the groups' order; every parameter name of the model; and,
    with the flattened state ``flat``, the tensor of it that is each parameter itself (same
    storage, offset, shape, strides: ``model.state_dict()`` holds such views), where it is
    there (not a copy). None when neither model nor optimizer is given."""
    if model is None and optimizer is None:
        return None
    from ckptstore_core.lossy import ParamNames

    named: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters():  # a tied parameter: its first name
            named.setdefault(id(p), name)
    if optimizer is None:
        optimizers: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    else:
        optimizers = list(optimizer)
    groups = tuple(
        tuple(tuple(named.get(id(p)) for p in g["params"]) for g in opt.param_groups)
        for opt in optimizers
    )
    tensors: tuple[tuple[str, str], ...] = ()
    if flat is not None and model is not None:
        by_identity = {_identity(t): name for name, t in flat.tensors}
        by_identity.pop(None, None)
        own = ((n, by_identity.get(_identity(p.detach()))) for n, p in model.named_parameters())
        tensors = tuple((n, t) for n, t in own if t is not None)
    out = ParamNames(groups, tuple(named.values()), tensors)
    return json.dumps(out.to_json(), separators=(",", ":"))


def _identity(t: torch.Tensor) -> tuple[object, ...] | None:
    """Where a strided tensor's bytes are: two tensors with the same identity are the same
    tensor (tied weights, a parameter and its ``state_dict`` view). None: no storage to
    compare by."""
    storage = t.untyped_storage()
    if not (storage.nbytes() and storage.data_ptr()):
        return None
    return (t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
