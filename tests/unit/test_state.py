"""flatten/unflatten: exact round trips of real training state through the wire's byte form."""

from __future__ import annotations

import ast
import json
import math
import random
import struct
import sys
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import state as state_module
from ckptstore.state import (
    FlatState,
    dtype_from_wire,
    dtype_to_wire,
    flatten,
    referenced_tensors,
    tensor_bytes,
    tensor_from_bytes,
    unflatten,
    upload_order,
)
from support.states import assert_same_state

WIRE_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# ------------------------------------------------------------------------------- helpers


def send(flat: FlatState, *, as_body: bool = True) -> dict[str, torch.Tensor]:
    """What the receiving end rebuilds from the wire.

    ``as_body``: like a safetensors body, all tensors back to back in one bytearray and rebuilt
    from memoryview slices of it (offsets need not be aligned). Otherwise each from ``bytes``.
    """
    parts = [
        (name, dtype_to_wire(t.dtype), list(t.shape), bytes(tensor_bytes(t)))
        for name, t in flat.tensors
    ]
    # Through JSON, as the header travels: shapes come back as plain lists of ints.
    header = json.loads(json.dumps([(n, c, s) for n, c, s, _ in parts]))
    if not as_body:
        return {
            n: tensor_from_bytes(raw, c, s)
            for (n, c, s), (*_, raw) in zip(header, parts, strict=True)
        }
    body = bytearray(b"".join(raw for *_, raw in parts))
    view = memoryview(body)
    out, offset = {}, 0
    for (name, code, shape), (*_, raw) in zip(header, parts, strict=True):
        out[name] = tensor_from_bytes(view[offset : offset + len(raw)], code, shape)
        offset += len(raw)
    return out


def roundtrip(obj: object, *, as_body: bool = True) -> Any:
    flat = flatten(obj)
    return unflatten(flat.skeleton, send(flat, as_body=as_body))


def raw(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and all) of ``dtype``."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == torch.bool:
        data &= 1
    return torch.from_numpy(data).view(dtype).reshape(shape)


# --------------------------------------------------------------------- real training state


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.norm(self.embed(x)))
        out: torch.Tensor = self.head(h)
        return out


def train_state(seed: int = 0) -> tuple[dict[str, Any], TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for _ in range(2):
        loss = model(torch.randint(0, 11, (4,))).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
        "step": 2,
        "best_loss": float(loss.detach()),
    }
    return state, model, opt


def test_training_state_roundtrip_exact() -> None:
    state, _, _ = train_state()
    assert isinstance(state["model"], OrderedDict)
    assert list(state["optimizer"]["state"]) == [0, 1, 2, 3, 4]  # int keys
    for as_body in (True, False):
        assert_same_state(state, roundtrip(state, as_body=as_body))


def test_training_state_resumes() -> None:
    state, model, opt = train_state()
    flat = flatten(state)
    names = [n for n, _ in flat.tensors]
    assert "model/embed.weight" in names and "model/head.weight" not in names  # tied: sent once
    assert "optimizer/state/0/exp_avg_sq" in names
    assert "rng/torch" in names
    back = unflatten(flat.skeleton, send(flat))
    assert back["model"]["head.weight"] is back["model"]["embed.weight"]

    fresh = TinyLM()
    fresh.load_state_dict(back["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.OneCycleLR(fresh_opt, max_lr=0.1, total_steps=10)
    fresh_opt.load_state_dict(back["optimizer"])
    fresh_sched.load_state_dict(back["scheduler"])
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    after = (random.random(), np.random.random(), torch.rand(3))

    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    assert after[0] == random.random() and after[1] == np.random.random()
    assert torch.equal(after[2], torch.rand(3))
    assert_same_state(opt.state_dict(), fresh_opt.state_dict(), same_objects=False)
    assert_same_state(model.state_dict(), fresh.state_dict(), same_objects=False)


# ------------------------------------------------------------------------------- dtypes


def test_dtype_table_is_exactly_the_wire_table() -> None:
    for code, dtype in WIRE_DTYPES.items():
        assert dtype_to_wire(dtype) == code
        assert dtype_from_wire(code) is dtype
    for dtype in (torch.complex64, torch.complex128, torch.qint8, torch.float8_e4m3fnuz):
        with pytest.raises(TypeError, match="no wire code"):
            dtype_to_wire(dtype)
    for code in ("F32 ", "f32", "C64", "float32", ""):
        with pytest.raises(ValueError, match="unknown wire dtype"):
            dtype_from_wire(code)


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        (1, torch.int32, b"\x01\x00\x00\x00"),
        (-2, torch.int16, b"\xfe\xff"),
        (1.0, torch.bfloat16, b"\x80\x3f"),
        (1.0, torch.float16, b"\x00\x3c"),
        (1.0, torch.float32, b"\x00\x00\x80\x3f"),
        (1.0, torch.float8_e4m3fn, b"\x38"),
        (1.0, torch.float8_e5m2, b"\x3c"),
        (True, torch.bool, b"\x01"),
        (2**63, torch.uint64, b"\x00" * 7 + b"\x80"),
    ],
)
def test_tensor_bytes_are_little_endian(value: object, dtype: torch.dtype, expected: bytes) -> None:
    t = torch.tensor(value, dtype=dtype)
    assert raw(t) == expected  # 0-d
    assert raw(t.expand(2)) == expected * 2  # stride 0


SHAPES = [(), (0, 3), (3, 0), (5,), (2, 3, 4)]


@pytest.mark.parametrize("code", list(WIRE_DTYPES))
def test_every_dtype_and_shape_roundtrips(code: str) -> None:
    dtype = WIRE_DTYPES[code]
    base = random_tensor(dtype, (4, 6), seed=len(code))
    tensors: dict[str, object] = {
        f"s{i}": random_tensor(dtype, s, seed=i) for i, s in enumerate(SHAPES)
    }
    tensors["transposed"] = base.T
    tensors["strided"] = base[::2, 1::3]
    tensors["column"] = base[:, 2]
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        data = tensor_bytes(t)
        assert data.format == "B" and data.ndim == 1
        assert len(data) == t.numel() * dtype.itemsize, name
        assert bytes(data) == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    back = roundtrip(tensors)
    assert_same_state(tensors, back)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in back.items()} == {
        n: (dtype, tuple(t.shape)) for n, t in tensors.items() if isinstance(t, torch.Tensor)
    }


def test_tensor_bytes_with_odd_strides() -> None:
    # Contiguous by torch's rules (size-1 and empty dims ignore strides), yet odd strides.
    base = torch.arange(24, dtype=torch.int16)
    cases = [
        base[::7][:1],
        base.reshape(24, 1)[::5],
        base.reshape(4, 6)[:, :0],
        torch.empty_strided((1, 3), (99, 1), dtype=torch.int16).fill_(3),
        torch.empty_strided((2, 0), (5, 2), dtype=torch.int16),
        base[3],
        base.expand(2, 24),
    ]
    for t in cases:
        expected = np.asarray(t.tolist(), dtype="<i2").tobytes()
        assert raw(t) == expected, (t.shape, t.stride())
        back = tensor_from_bytes(expected, "I16", t.shape)
        assert back.tolist() == t.tolist() and back.shape == t.shape


def test_tensor_bytes_is_zero_copy_for_contiguous_cpu() -> None:
    t = torch.zeros(4, dtype=torch.int32)
    view = tensor_bytes(t)
    t[1] = 0x01020304
    assert bytes(view[4:8]) == b"\x04\x03\x02\x01"
    del t
    assert len(bytes(view)) == 16  # the view keeps the memory alive


def test_tensor_bytes_detaches_and_resolves_views() -> None:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    assert raw(p.T) == np.arange(6.0, dtype="<f4").reshape(2, 3).T.tobytes()
    neg = torch._neg_view(torch.arange(3.0))
    assert raw(neg) == np.array([-0.0, -1.0, -2.0], dtype="<f4").tobytes()


def test_tensor_from_bytes_shares_a_writable_buffer() -> None:
    buf = bytearray(struct.pack("<3f", 1.0, 2.0, 3.0))
    t = tensor_from_bytes(buf, "F32", [3])
    buf[0:4] = struct.pack("<f", 9.0)
    assert t.tolist() == [9.0, 2.0, 3.0]
    body = bytearray(b"\x00" + struct.pack("<2d", 1.5, -2.5))
    t = tensor_from_bytes(memoryview(body)[1:], "F64", (2, 1))  # misaligned: copied
    assert t.shape == (2, 1) and t.flatten().tolist() == [1.5, -2.5]


def test_tensor_from_bytes_copies_readonly_without_warning() -> None:
    data = struct.pack("<2h", 7, -7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = tensor_from_bytes(data, "I16", [2])
        t2 = tensor_from_bytes(memoryview(data), "I16", [2])
    t[0] = 1
    assert data == struct.pack("<2h", 7, -7) and t2.tolist() == [7, -7]


@pytest.mark.parametrize(("shape", "n"), [((), 4), ((0, 3), 0), ((3, 0, 2), 0), ((1, 1), 4)])
def test_tensor_from_bytes_zero_d_and_empty(shape: tuple[int, ...], n: int) -> None:
    t = tensor_from_bytes(bytearray(n), "F32", shape)
    assert t.shape == shape and t.dtype == torch.float32


@pytest.mark.parametrize(
    ("data", "code", "shape", "match"),
    [
        (b"\x00" * 3, "F32", [1], "do not hold"),
        (b"\x00" * 8, "F32", [1], "do not hold"),
        (b"", "F32", [1], "do not hold"),
        (b"\x00" * 4, "F32", [-1], "bad tensor shape"),
        (b"\x00" * 4, "F32", [1.0], "bad tensor shape"),
        (b"\x00" * 4, "X32", [1], "unknown wire dtype"),
    ],
)
def test_tensor_from_bytes_rejects(data: bytes, code: str, shape: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tensor_from_bytes(data, code, shape)


# ---------------------------------------------------------------------- names and ties


def names_of(obj: object) -> list[str]:
    return [n for n, _ in flatten(obj).tensors]


def test_names_follow_the_key_path_escaped() -> None:
    t = [torch.tensor(float(i)) for i in range(9)]
    state = {
        "model": {"fc.weight": t[0], "a/b": t[1], "c~d": t[2], "~1": t[3]},
        "optimizer": {"state": {0: {"exp_avg": t[4]}}},
        "list": [t[5], (None, t[6])],
        True: t[7],
        None: {1.5: t[8], 10**1000: t[0].clone(), -(10**999): t[1].clone()},
    }
    assert names_of(state) == [
        "model/fc.weight",
        "model/a~1b",
        "model/c~0d",
        "model/~01",
        "optimizer/state/0/exp_avg",
        "list/0",
        "list/1/1",
        "True",
        "None/1.5",
        "None/" + hex(10**1000),
        "None/" + str(-(10**999)),
    ]
    assert names_of(t[0]) == [
        "~2"
    ]  # "" is no safetensors name (see tests/integration/test_states.py)
    assert names_of([t[0], {"": t[1]}]) == ["0", "1/"]


def test_colliding_names_are_disambiguated() -> None:
    a, b, c, d = (torch.tensor([i]) for i in range(4))
    state: dict[str, dict[object, object]] = {"d": {0: a, "0": b}, "e": {"x": {1: c}, "x~": d}}
    state["e"]["x/1"] = torch.tensor([9])
    state["d"][True] = torch.tensor([8])  # renders "True": no clash
    flat = flatten(state)
    assert [n for n, _ in flat.tensors] == ["d/0", "d/0~2", "d/True", "e/x/1", "e/x~0", "e/x~11"]
    back = unflatten(flat.skeleton, send(flat))
    assert_same_state(state, back)
    state2 = {0: a, "0": b, "0~2": c}
    assert names_of(state2) == ["0", "0~2", "0~02"]
    assert_same_state(state2, roundtrip(state2))


def test_tied_tensors_sent_once_and_stay_tied() -> None:
    w = torch.randn(3, 4)
    state = {
        "a": w,
        "b": {"same_object": w, "same_view": w.view(3, 4), "detached": w.detach()},
        "not_tied": {"transposed": w.T, "row": w[1], "other_dtype": w.view(torch.int32)},
    }
    flat = flatten(state)
    assert [n for n, _ in flat.tensors] == [
        "a",
        "not_tied/transposed",
        "not_tied/row",
        "not_tied/other_dtype",
    ]
    back = unflatten(flat.skeleton, send(flat))
    assert back["b"]["same_object"] is back["a"]
    assert back["b"]["same_view"] is back["a"] and back["b"]["detached"] is back["a"]
    assert back["not_tied"]["transposed"] is not back["a"]
    assert_same_state(state, back)


def test_empty_tensors_tie_only_by_identity() -> None:
    e = torch.empty(0, 3)
    state = {"x": e, "y": e, "z": torch.empty(0, 3)}
    flat = flatten(state)
    assert [n for n, _ in flat.tensors] == ["x", "z"]
    back = unflatten(flat.skeleton, send(flat))
    assert back["x"] is back["y"] and back["z"] is not back["x"]


def test_flat_tensors_are_detached_originals_not_copies() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    ((name, t),) = flatten({"p": p}).tensors
    assert name == "p" and not t.requires_grad
    assert t.data_ptr() == p.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_come_back_on_cpu() -> None:
    t = torch.arange(5, device="cuda", dtype=torch.bfloat16)
    back = roundtrip({"t": t, "u": t})
    assert back["t"].device.type == "cpu" and back["u"] is back["t"]
    assert raw(back["t"]) == raw(t.cpu())


# ------------------------------------------------------------------------ skeleton leaves


def test_skeleton_format_is_pinned() -> None:
    state = {
        "w": torch.zeros(2),
        "step": 3,
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "k": {0: None, True: [1.0, "x"]},
        "big": 2**64,
        "inf": -math.inf,
        "b": b"\x00\xff",
    }
    assert flatten(state).skeleton == (
        '{"v":1,"root":{"t":"dict","v":[["w",{"t":"tensor","n":"w"}],["step",3],["lr",0.1],'
        '["betas",{"t":"tuple","v":[0.9,0.999]}],["k",{"t":"dict","v":[[0,null],[true,[1.0,"x"]]]}],'
        '["big",{"t":"int","v":"0x10000000000000000"}],["inf",{"t":"float","v":"fff0000000000000"}],'
        '["b",{"t":"bytes","v":"AP8="}]]}}'
    )


def float_from_bits(bits: int) -> float:
    f: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return f


FLOATS = [
    0.0,
    -0.0,
    1.0,
    0.1,
    -1e300,
    5e-324,
    sys.float_info.max,
    math.inf,
    -math.inf,
    math.nan,
    float_from_bits(0xFFF8000000000000),  # negative nan
    float_from_bits(0x7FF0000000000001),  # signalling nan with a payload
]
INTS = [0, 1, -1, 2**53, 2**53 + 1, -(2**53) - 1, 2**63, -(2**64), 10**5000, -(7**9000)]


def test_scalar_leaves_roundtrip_exactly() -> None:
    state = {
        "floats": FLOATS,
        "ints": INTS,
        "misc": [True, False, None, "", "ünï/~\ud800", b"", bytes(range(256))],
        "sizes": (torch.Size([]), torch.Size([0, 3]), torch.Size([2**40])),
        "dtypes": [getattr(torch, n) for n in state_module._DTYPE_NAMES if hasattr(torch, n)],
        "aliases": [torch.float, torch.half, torch.long, torch.cfloat],
    }
    back = roundtrip(state)
    assert_same_state(state, back)
    assert math.copysign(1, back["floats"][1]) == -1
    # Nothing in the skeleton is non-standard JSON.
    json.loads(flatten(state).skeleton, parse_constant=lambda c: pytest.fail(c))


def test_key_types_are_kept() -> None:
    state = {
        0: "int",
        "1": "str",
        True: "bool",
        None: "none",
        1.5: "float",
        math.inf: "inf",
        2**100: "big",
        "": "empty",
    }
    back = roundtrip(state)
    assert_same_state(state, back)
    assert [type(k) for k in back] == [int, str, bool, type(None), float, float, int, str]
    assert_same_state({-0.0: "negzero"}, roundtrip({-0.0: "negzero"}))
    assert_same_state({math.nan: 1, -math.nan: 2}, roundtrip({math.nan: 1, -math.nan: 2}))
    assert_same_state({1: "a"}, roundtrip({1: "a"}))
    assert_same_state({True: "a"}, roundtrip({True: "a"}))
    assert_same_state({1.0: "a"}, roundtrip({1.0: "a"}))


def test_containers_keep_their_kind_and_order() -> None:
    od: OrderedDict[str, object] = OrderedDict([("z", 1), ("a", ())])
    od._metadata = OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]
    state = {
        "tuple": (1, [2], ((),)),
        "list": [(1,), [], {}],
        "order": {"b": 1, "a": 2, 3: 3},
        "od": od,
        "plain_od": OrderedDict(x=1),
    }
    back = roundtrip(state)
    assert_same_state(state, back)
    assert back["od"]._metadata == {"": {"version": 2}}
    assert not hasattr(back["plain_od"], "_metadata")
    assert_same_state((), roundtrip(()))
    assert_same_state([], roundtrip([]))
    assert_same_state(None, roundtrip(None))
    assert_same_state(7, roundtrip(7))


NP_DTYPES = [
    "|b1",
    "|u1",
    "|i1",
    "<i2",
    ">i2",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    ">f8",
    "<f8",
    "<c8",
    "<c16",
]


@pytest.mark.parametrize("dt", NP_DTYPES)
def test_numpy_arrays_and_scalars(dt: str) -> None:
    rng = np.random.default_rng(0)
    d = np.dtype(dt)
    arr = rng.integers(0, 256, 24 * d.itemsize, dtype=np.uint8).view(d).reshape(2, 3, 4)
    if d.kind == "b":
        arr = arr.view(np.uint8) & 1
        arr = arr.view(d)
    state = {
        "arr": arr,
        "0d": arr.reshape(-1)[:1].reshape(()),
        "empty": arr[:0],
        "view": arr[:, ::2].T,
        "scalar": arr.reshape(-1)[0] if d.isnative else None,
    }
    back = roundtrip(state)
    assert_same_state(state, back)
    assert back["arr"].flags.writeable
    if d.isnative:
        assert type(back["scalar"]) is d.type


def test_numpy_scalar_types() -> None:
    state = [
        np.float64(-0.0),
        np.float32(np.nan),
        np.int64(-(2**63)),
        np.uint8(255),
        np.bool_(True),
        np.float16(1),
    ]
    state += [np.longdouble(1) / 3, np.complex64(1 - 2j), np.int8(-1), np.uint64(2**64 - 1)]
    back = roundtrip(state)
    assert_same_state(state, back)
    assert [type(x) for x in back] == [type(x) for x in state]


def test_large_numpy_array_travels_as_a_tensor() -> None:
    big = np.arange(40_000, dtype=np.float32).reshape(200, 200)[:, ::2]  # non-contiguous
    swapped = np.arange(40_000, dtype=">f4")  # non-native order: stays in the skeleton
    flat = flatten({"rng": {"big": big, "swapped": swapped}})
    assert [n for n, _ in flat.tensors] == ["rng/big"]
    assert len(flat.skeleton) < 300_000
    back = unflatten(flat.skeleton, send(flat))
    assert_same_state({"rng": {"big": big, "swapped": swapped}}, back)
    assert referenced_tensors(flat.skeleton) == ["rng/big"]


def test_rng_states_roundtrip() -> None:
    gen = torch.Generator().manual_seed(3)
    state = {
        "python": random.Random(5).getstate(),
        "numpy": np.random.RandomState(7).get_state(),
        "numpy_dict": np.random.default_rng(9).bit_generator.state,
        "torch": torch.get_rng_state(),
        "generator": gen.get_state(),
    }
    back = roundtrip(state)
    assert_same_state(state, back)
    rs = np.random.RandomState()
    rs.set_state(back["numpy"])
    assert rs.random() == np.random.RandomState(7).random()


# ------------------------------------------------------------------------ rejected input


def fn() -> None:
    pass


class Thing:
    pass


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("leaf", "what"),
    [
        ({1, 2}, "unsupported type set"),
        (frozenset(), "unsupported type frozenset"),
        (1 + 2j, "unsupported type complex"),
        (fn, "unsupported type function"),
        (Thing(), "unsupported type Thing"),
        (bytearray(b"x"), "unsupported type bytearray"),
        (defaultdict(list), "unsupported type defaultdict"),
        (Point(1, 2), "unsupported type Point"),
        (torch.device("cpu"), "unsupported type device"),
        (np.array(["a"]), "unsupported numpy dtype"),
        (np.array([None], dtype=object), "unsupported numpy dtype"),
        (np.array([1], dtype="M8[s]"), "unsupported numpy dtype"),
        (np.str_("a"), "unsupported numpy scalar"),
        (np.longlong(1), "unsupported numpy scalar"),
        (torch.ones(2, dtype=torch.complex64), "unsupported tensor dtype"),
        (torch.ones(2, device="meta"), "meta tensor"),
        (torch.bits8, "unsupported dtype"),
    ],
)
def test_unsupported_leaves_name_the_path(leaf: object, what: str) -> None:
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "foo": leaf}]}}
    with pytest.raises(TypeError) as info:
        flatten(state)
    assert what in str(info.value)
    assert "at 'optimizer/param_groups/0/foo'" in str(info.value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # beta and deprecated tensor kinds
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.ones(2).to_sparse(), "unsupported torch.sparse_coo tensor"),
        (lambda: torch.ones(2, 2).to_sparse_csr(), "unsupported torch.sparse_csr tensor"),
        (
            lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
            "unsupported quantized tensor",
        ),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "unsupported nested tensor",
        ),
    ],
)
def test_unsupported_tensor_kinds_name_the_path(make: Any, what: str) -> None:
    with pytest.raises(TypeError, match=f"^{what} at 'model/w'$"):
        flatten({"model": {"w": make()}})


def test_unsupported_message_is_exact() -> None:
    with pytest.raises(
        TypeError, match=r"^unsupported type set at 'optimizer/param_groups/0/foo'$"
    ):
        flatten({"optimizer": {"param_groups": [{"foo": {1}}]}})
    with pytest.raises(TypeError, match="at the root"):
        flatten({1})


@pytest.mark.parametrize("key", [(1, 2), b"k", np.int64(1), frozenset(), torch.tensor(1)])
def test_unsupported_keys_name_the_path(key: object) -> None:
    with pytest.raises(TypeError, match=r"unsupported key type .* at 'a/b'"):
        flatten({"a": {"b": {key: 1}}})


def test_cycles_are_rejected() -> None:
    d: dict[str, object] = {}
    d["self"] = [d]
    with pytest.raises(ValueError, match="cycle at 'self/0'"):
        flatten(d)
    shared = [1, 2]
    assert_same_state({"a": shared, "b": shared}, roundtrip({"a": shared, "b": shared}))


def test_metadata_may_not_hold_tensors() -> None:
    od: OrderedDict[str, object] = OrderedDict(w=torch.ones(1))
    od._metadata = {"": {"t": torch.ones(1)}}  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="unexpected tensor"):
        flatten(od)


# ------------------------------------------------------------------------------ prefix


def prefix_state() -> dict[str, Any]:
    t = [torch.full((2,), float(i)) for i in range(6)]
    return {
        "model": {"w": t[0], "sub": {"b": t[1]}, "empty": {}, "n": 3, "tup": (t[2], "x")},
        "modelx": t[3],
        "optimizer": {"state": {0: {"m": t[4]}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 5,
        "e": {},
        "layers": [{"w": t[5]}, {"w": t[5] + 1}, []],
    }


def load(flat: FlatState, prefix: str) -> Any:
    wire = send(flat)
    return unflatten(
        flat.skeleton, {n: t for n, t in wire.items() if n.startswith(prefix)}, prefix=prefix
    )


def test_prefix_keeps_the_subtree_and_its_ancestors() -> None:
    state = prefix_state()
    flat = flatten(state)
    assert_same_state({"model": state["model"]}, load(flat, "model/"))
    assert_same_state({"model": state["model"], "modelx": state["modelx"]}, load(flat, "model"))
    assert_same_state(
        {"optimizer": {"state": state["optimizer"]["state"]}}, load(flat, "optimizer/state/")
    )
    assert_same_state(
        {"optimizer": {"param_groups": [{"lr": 0.1}]}}, load(flat, "optimizer/param_groups/0/lr")
    )
    assert_same_state({"model": {"tup": (state["model"]["tup"][0],)}}, load(flat, "model/tup/0"))
    assert_same_state({"step": 5}, load(flat, "step"))
    assert_same_state({"e": {}}, load(flat, "e"))
    # List ancestors are compacted: only the kept elements remain.
    assert_same_state({"layers": [{"w": state["layers"][1]["w"]}]}, load(flat, "layers/1/"))
    assert_same_state({}, load(flat, "nothing/"))
    assert_same_state(state, load(flat, ""))
    assert referenced_tensors(flat.skeleton, "model/") == ["model/w", "model/sub/b", "model/tup/0"]
    assert referenced_tensors(flat.skeleton, "nothing/") == []


def test_prefix_on_other_roots() -> None:
    t = torch.ones(1)
    assert load(flatten([t, {"a": 1}]), "1/") == [{"a": 1}]
    assert load(flatten((t,)), "x") == ()
    assert load(flatten(OrderedDict(a=1)), "x") == OrderedDict()
    assert load(flatten(t), "x") is None
    assert load(flatten(t), "") is not None


def test_prefix_and_tied_tensors() -> None:
    w = torch.randn(2)
    flat = flatten({"a": {"w": w}, "b": {"w": w}})
    wire = send(flat)
    only_b = {n: t for n, t in wire.items() if n.startswith("b/")}
    with pytest.raises(KeyError, match="referenced_tensors"):
        unflatten(flat.skeleton, only_b, prefix="b/")
    needed = referenced_tensors(flat.skeleton, "b/")
    assert needed == ["a/w"]
    back = unflatten(flat.skeleton, {n: wire[n] for n in needed}, prefix="b/")
    assert list(back) == ["b"] and back["b"]["w"] is wire["a/w"]


def test_missing_tensor_is_a_clear_error() -> None:
    flat = flatten({"model": {"w": torch.ones(1)}})
    with pytest.raises(KeyError, match=r"'model/w'.*missing"):
        unflatten(flat.skeleton, {})
    with pytest.raises(TypeError, match="not a tensor"):
        unflatten(flat.skeleton, {"model/w": b"\x00"})  # type: ignore[dict-item]
    assert (
        unflatten(flat.skeleton, {"model/w": torch.zeros(1), "extra": torch.ones(1)})["model"]["w"]
        == 0
    )


# ------------------------------------------------------------------------ malformed input


def skel(root: str) -> str:
    return '{"v":1,"root":' + root + "}"


MALFORMED = [
    "not json",
    "",
    "[]",
    "null",
    '{"v":1}',
    '{"root":null}',
    '{"v":2,"root":null}',
    '{"v":true,"root":null}',
    '{"v":"1","root":null}',
    '{"v":1,"root":null,"x":0}',
    skel("NaN"),
    skel("Infinity"),
    skel("{}"),
    skel('{"t":"nope"}'),
    skel('{"t":"tuple"}'),
    skel('{"t":"tuple","v":{}}'),
    skel('{"t":"tuple","v":[],"x":1}'),
    skel('{"t":"dict","v":{}}'),
    skel('{"t":"dict","v":[[1]]}'),
    skel('{"t":"dict","v":[[1,2,3]]}'),
    skel('{"t":"dict","v":[[[1],2]]}'),
    skel('{"t":"dict","v":[[{"t":"bytes","v":""},2]]}'),
    skel('{"t":"dict","v":[[1,2],[1,3]]}'),
    skel('{"t":"dict","v":[[1,2],[true,3]]}'),
    skel('{"t":"dict","v":[[1,2],[1.0,3]]}'),
    skel('{"t":"dict","v":[],"m":{}}'),
    skel('{"t":"tensor"}'),
    skel('{"t":"tensor","n":5}'),
    skel('{"t":"tensor","n":"a","v":1}'),
    skel('{"t":"int","v":12}'),
    skel('{"t":"int","v":"0xzz"}'),
    skel('{"t":"float","v":"7ff8"}'),
    skel('{"t":"float","v":"zzzzzzzzzzzzzzzz"}'),
    skel('{"t":"float","v":1.0}'),
    skel('{"t":"bytes","v":"!!"}'),
    skel('{"t":"bytes","v":null}'),
    skel('{"t":"size","v":[-1]}'),
    skel('{"t":"size","v":[1.5]}'),
    skel('{"t":"size","v":"12"}'),
    skel('{"t":"dtype","v":"float33"}'),
    skel('{"t":"dtype","v":"__class__"}'),
    skel('{"t":"ndarray","d":"|O","s":[1],"v":""}'),
    skel('{"t":"ndarray","d":"nonsense","s":[1],"v":""}'),
    skel('{"t":"ndarray","d":"<f4","s":[2],"v":"AAAAAA=="}'),
    skel('{"t":"ndarray","d":"<f4","s":[1],"v":"AAAAAA==","n":"x"}'),
    skel('{"t":"ndarray","d":"<f4","s":[1]}'),
    skel('{"t":"ndarray","d":"f4","s":[1],"v":"AAAAAA=="}'),
    skel('{"t":"npscalar","d":"<f8","v":"AAAAAA=="}'),
    skel('{"t":"npscalar","d":"<U1","v":"AAAAAA=="}'),
    skel("[" * 100_000 + "]" * 100_000),
]


@pytest.mark.parametrize("skeleton", MALFORMED)
def test_malformed_skeleton_is_a_value_error(skeleton: str) -> None:
    with pytest.raises(ValueError):
        unflatten(skeleton, {"a": torch.ones(1), "x": torch.ones(1)})
    with pytest.raises(ValueError):
        referenced_tensors(skeleton)


def test_ndarray_tensor_mismatch_is_a_value_error() -> None:
    sk = skel('{"t":"ndarray","d":"<f4","s":[2],"n":"x"}')
    with pytest.raises(ValueError, match="wants"):
        unflatten(sk, {"x": torch.ones(3)})
    with pytest.raises(ValueError, match="wants"):
        unflatten(sk, {"x": torch.ones(2, dtype=torch.float64)})
    assert unflatten(sk, {"x": torch.ones(2)}).tolist() == [1.0, 1.0]


def test_no_pickle_in_state_module() -> None:
    tree = ast.parse(Path(state_module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert imported.isdisjoint({"pickle", "marshal", "copyreg", "dill", "cloudpickle", "shelve"})
    assert "torch.load" not in Path(state_module.__file__).read_text()


# ------------------------------------------------------------------------------ properties

KEYS = st.one_of(
    st.text(alphabet="0a/~2", max_size=3),
    st.integers(-2, 3),
    st.integers(),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = WIRE_DTYPES[draw(st.sampled_from(sorted(WIRE_DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    data = bytearray(
        draw(
            st.binary(
                min_size=math.prod(shape) * dtype.itemsize,
                max_size=math.prod(shape) * dtype.itemsize,
            )
        )
    )
    if dtype == torch.bool:
        data = bytearray(b & 1 for b in data)
    t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = t.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "T", "step"]))
    if view == "T" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    return t


SCALARS = st.one_of(
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.binary(max_size=4),
)


@st.composite
def states(draw: st.DrawFn) -> object:
    pool = draw(st.lists(tensors(), max_size=4))
    leaves = st.one_of(SCALARS, tensors(), *([st.sampled_from(pool)] if pool else []))
    return draw(
        st.recursive(
            leaves,
            lambda children: st.one_of(
                st.lists(children, max_size=4),
                st.lists(children, max_size=4).map(tuple),
                st.dictionaries(KEYS, children, max_size=4),
            ),
            max_leaves=16,
        )
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(), st.booleans())
def test_property_roundtrip(state: object, as_body: bool) -> None:
    flat = flatten(state)
    names = [n for n, _ in flat.tensors]
    assert len(names) == len(set(names))
    assert sorted(referenced_tensors(flat.skeleton)) == sorted(names)
    assert_same_state(state, unflatten(flat.skeleton, send(flat, as_body=as_body)))
    # Deterministic: the same state flattens to the same names and skeleton.
    again = flatten(state)
    assert again.skeleton == flat.skeleton and [n for n, _ in again.tensors] == names


def prune(obj: object, prefix: str, path: str = "", root: bool = True) -> object:
    """A plain reference for unflatten's prefix rule, written against the Python object."""
    if path.startswith(prefix):  # the root's path "" only when the prefix is "" too
        return obj

    def join(key: object) -> str:
        escaped = str(key).replace("~", "~0").replace("/", "~1")
        return escaped if root else f"{path}/{escaped}"

    if isinstance(obj, dict):
        kept = {k: prune(v, prefix, join(k), False) for k, v in obj.items()}
        out = {k: v for k, v in kept.items() if v is not DROPPED}
        return out if out or root else DROPPED
    if isinstance(obj, list | tuple):
        items = [prune(v, prefix, join(i), False) for i, v in enumerate(obj)]
        seq = [v for v in items if v is not DROPPED]
        return type(obj)(seq) if seq or root else DROPPED
    return None if root else DROPPED


DROPPED = object()


@settings(max_examples=100, deadline=None)
@given(states(), st.text(alphabet="0a/~12", max_size=4))
def test_property_prefix(state: object, prefix: str) -> None:
    flat = flatten(state)
    wire = send(flat)
    full = unflatten(flat.skeleton, wire)
    needed = referenced_tensors(flat.skeleton, prefix)
    assert set(needed) <= set(wire)
    back = unflatten(flat.skeleton, {n: wire[n] for n in needed}, prefix=prefix)
    assert_same_state(prune(full, prefix), back)


def test_uploads_send_wider_then_larger_tensors_first() -> None:
    tensors = [
        ("bias", torch.zeros(4)),
        ("half", torch.zeros(1000, dtype=torch.bfloat16)),
        ("weight", torch.zeros(100)),
        ("steps", torch.zeros(3, dtype=torch.int64)),
        ("also_bias", torch.zeros(4)),
    ]
    order = [name for name, _ in upload_order(tensors)]
    assert order == ["steps", "weight", "bias", "also_bias", "half"]
