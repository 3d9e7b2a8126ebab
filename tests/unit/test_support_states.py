"""support.states.assert_same_state, the tests' one bit-exact comparison, catches every kind
of difference that any of the four comparators it replaced caught (and those none did)."""

from __future__ import annotations

import math
import re
import struct
from collections import Counter, OrderedDict, namedtuple
from collections.abc import Callable

import numpy as np
import pytest
import torch

from support.states import assert_same_state

Pair = namedtuple("Pair", "a b")


def nan_with_payload(payload: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0000 | payload))[0]
    return value


def base() -> dict[object, object]:
    w = torch.arange(6.0).reshape(2, 3)
    od: OrderedDict[str, object] = OrderedDict([("z", 1), ("a", 2)])
    od._metadata = OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    return {
        "w": w,
        "tied": w,
        "equal": w.clone(),  # the same values, not tied
        "bf16": torch.tensor([1.0, -0.0, math.nan], dtype=torch.bfloat16),
        "fp8": torch.arange(4, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "od": od,
        "counter": Counter({5: 2}),
        "tuple": (1, [2], Pair(3, 4)),
        "floats": [0.1, -0.0, math.inf, math.nan],
        "np": np.arange(3, dtype="<f4"),
        "npscalar": np.float32(1.5),
        "none": None,
        "flag": True,
        1.5: "float key",
    }


def test_a_state_is_the_same_as_its_copy() -> None:
    state = base()
    copy = base()
    copy["tied"] = copy["w"]
    assert_same_state(state, copy)
    assert_same_state(state, state)


def _set(path: tuple[object, ...], value: object) -> Callable[[dict[object, object]], None]:
    def change(state: dict[object, object]) -> None:
        node: object = state
        for key in path[:-1]:
            node = node[key]  # type: ignore[index]
        node[path[-1]] = value  # type: ignore[index]

    return change


def _retie(state: dict[object, object]) -> None:
    state["tied"] = state["w"]


def _untie(state: dict[object, object]) -> None:
    state["tied"] = state["w"].clone()


def _tie_other(state: dict[object, object]) -> None:
    state["equal"] = state["w"]


def _reorder(state: dict[object, object]) -> None:
    state["od"] = OrderedDict(reversed(list(state["od"].items())))  # type: ignore[attr-defined]
    state["od"]._metadata = OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]


def _drop_metadata(state: dict[object, object]) -> None:
    del state["od"]._metadata  # type: ignore[attr-defined]


def _metadata_version(state: dict[object, object]) -> None:
    state["od"]._metadata = OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]


def _str_key(state: dict[object, object]) -> None:
    state["optim"]["state"] = {"0": state["optim"]["state"][0]}  # type: ignore[index]


def _bool_key(state: dict[object, object]) -> None:
    del state[1.5]
    state[True] = "float key"


def _key_order(state: dict[object, object]) -> None:
    state["w"] = state.pop("w")


# each change of a copy, and what the failure says
DIFFERENCES: dict[str, tuple[Callable[[dict[object, object]], None], str]] = {
    "tensor-bits": (_set(("w",), torch.arange(6.0).reshape(2, 3) + 1e-7), "'w': bytes differ"),
    "tensor-dtype": (
        _set(("w",), torch.arange(6.0, dtype=torch.float64).reshape(2, 3)),
        "float32(2, 3) vs torch.float64",
    ),
    "tensor-shape": (
        _set(("w",), torch.arange(6.0).reshape(3, 2)),
        "(2, 3) vs torch.float32(3, 2)",
    ),
    "tensor-minus-zero": (
        _set(("bf16",), torch.tensor([1.0, 0.0, math.nan], dtype=torch.bfloat16)),
        "'bf16': bytes differ",
    ),
    "tensor-nan-payload": (
        _set(
            ("bf16",),
            torch.tensor([0x3F80, -0x8000, 0x7FC1], dtype=torch.int16).view(torch.bfloat16),
        ),
        "'bf16': bytes differ",
    ),
    "fp8-bits": (
        _set(("fp8",), torch.tensor([0, 1, 2, 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)),
        "'fp8': bytes differ",
    ),
    "tensor-subclass": (
        _set(("w",), torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))),
        "Tensor vs Parameter",
    ),
    "tie-lost": (_untie, "tie lost"),
    "spurious-tie": (_tie_other, "spurious tie"),
    "int-vs-str-key": (_str_key, "<key 0>: int vs str"),
    "float-vs-bool-key": (_bool_key, "<key 1.5>: float vs bool"),
    "key-order": (_key_order, "<key 'w'>: 'w' vs 'tied'"),
    "ordered-dict-order": (_reorder, "<key 'z'>: 'z' vs 'a'"),
    "metadata-missing": (_drop_metadata, "'od': _metadata"),
    "metadata-value": (_metadata_version, "'version': 1 vs 2"),
    "dict-vs-ordered-dict": (_set(("counter",), {5: 2}), "Counter vs dict"),
    "tuple-vs-list": (_set(("tuple",), [1, [2], Pair(3, 4)]), "tuple vs list"),
    "namedtuple-vs-tuple": (_set(("tuple",), (1, [2], (3, 4))), "Pair vs tuple"),
    "float-minus-zero": (_set(("floats",), [0.1, 0.0, math.inf, math.nan]), "-0.0 vs 0.0"),
    "float-nan-payload": (
        _set(("floats",), [0.1, -0.0, math.inf, nan_with_payload(1)]),
        "'floats'/3: nan vs nan",
    ),
    "int-vs-float": (_set(("optim", "param_groups"), [{"lr": 0}]), "float vs int"),
    "int-vs-bool": (_set(("flag",), 1), "bool vs int"),
    "none-vs-value": (_set(("none",), 0), "NoneType vs int"),
    "numpy-byte-order": (_set(("np",), np.arange(3, dtype=">f4")), "<f4(3,) vs >f4(3,)"),
    "numpy-bytes": (_set(("np",), np.arange(1, 4, dtype="<f4")), "'np': bytes differ"),
    "numpy-scalar-type": (_set(("npscalar",), np.float64(1.5)), "float32 vs float64"),
    "numpy-vs-tensor": (_set(("np",), torch.arange(3.0)), "ndarray vs Tensor"),
    "extra-key": (_set(("extra",), 1), "15 keys vs 16"),
}


@pytest.mark.parametrize(("change", "message"), DIFFERENCES.values(), ids=DIFFERENCES.keys())
def test_every_difference_fails(
    change: Callable[[dict[object, object]], None], message: str
) -> None:
    state = base()
    other = base()
    other["tied"] = other["w"]
    change(other)
    with pytest.raises(AssertionError, match=re.escape(message)):
        assert_same_state(state, other)


def test_ties_may_be_memory_rather_than_objects() -> None:
    """``same_objects=False``: tied tensors of ``expected`` need only share memory in
    ``actual`` (a state loaded into a model), and must still share it."""
    w = torch.ones(4)
    other = torch.ones(4)
    assert_same_state({"a": w, "b": w}, {"a": other, "b": other[:]}, same_objects=False)
    with pytest.raises(AssertionError, match="tie"):
        assert_same_state({"a": w, "b": w}, {"a": other, "b": other[:]})
    with pytest.raises(AssertionError, match="tie lost"):
        assert_same_state({"a": w, "b": w}, {"a": other, "b": other.clone()}, same_objects=False)


def test_the_message_names_the_path() -> None:
    state, other = base(), base()
    other["tied"] = other["w"]
    _str_key(other)
    with pytest.raises(
        AssertionError, match=re.escape("step 3/'optim'/'state'/<key 0>: int vs str")
    ):
        assert_same_state(state, other, path="step 3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_actual_tensors_are_on_the_cpu() -> None:
    w = torch.arange(4.0)
    assert_same_state({"w": w.cuda()}, {"w": w})  # expected may live anywhere
    with pytest.raises(AssertionError, match="cuda"):
        assert_same_state({"w": w}, {"w": w.cuda()})


@pytest.mark.skipif(
    np.finfo(np.longdouble).nmant != 63, reason="long double is not x87's 80-bit format here"
)
def test_long_double_padding_is_no_part_of_the_value() -> None:
    """x86's 80-bit long double fills 16 bytes; numpy leaves the last 6 as whatever memory
    held, so two equal values may differ there (seen with numpy 2.5)."""
    value = (np.longdouble(1) / 3).tobytes()[:10]
    one = np.frombuffer(value + b"\0" * 6, dtype=np.longdouble)
    other = np.frombuffer(value + b"\xff" * 6, dtype=np.longdouble)
    assert one.tobytes() != other.tobytes()
    assert_same_state(
        [one, one[0], one.astype(np.clongdouble)], [other, other[0], other.astype(np.clongdouble)]
    )
    flipped = np.frombuffer(bytes([value[0] ^ 1]) + value[1:] + b"\0" * 6, dtype=np.longdouble)
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_same_state(one, flipped)
    with pytest.raises(AssertionError):
        assert_same_state(one[0], flipped[0])
