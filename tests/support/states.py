"""Training states, and the one bit-exact comparison of a state with the state it came back as.

``assert_same_state(expected, actual)`` is the bit-exact invariant (docs/architecture.md) as a test
sees it: every difference between the two is a failure, whatever it is.

* The same type at every node: ``dict`` is not ``OrderedDict`` or ``Counter``, ``list`` is
  not ``tuple``, a namedtuple stays its class, ``int`` is not ``bool`` or ``float``.
* Dicts: the same keys, of the same types, in the same order (optimizer state keys are
  ints, not strings; ``1``, ``1.0`` and ``True`` differ), and the same ``_metadata``
  attribute (``nn.Module.state_dict``'s), compared the same way.
* Tensors: plain ``torch.Tensor`` on the CPU after the round trip (a ``Parameter`` comes
  back as its data: expect ``p.detach()``), the same dtype and shape, and the same raw
  bytes: NaN payloads, -0.0 and every fp8/bf16 bit pattern included. Ties are kept:
  tensors that share memory in ``expected`` are one object in ``actual`` (or, with
  ``same_objects=False``, for states handed through ``load_state_dict``, share memory),
  and no tensors are tied in ``actual`` that were not in ``expected``.
* numpy arrays and scalars: the same dtype (byte order included), shape and bytes (of a
  long double, the bytes that hold its value: x86's 80-bit format sits in 16 bytes whose
  last 6 are padding that numpy leaves as whatever the memory held).
* Python floats bit by bit (NaN payloads, -0.0); every other leaf by type and ``==``.

The failure message names the path of the first difference.
"""

from __future__ import annotations

import copy
import random
import struct
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from ckptstore.state import tensor_bytes

__all__ = ["assert_same_state", "training_states"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t))


def _value_bits(dtype: np.dtype[Any]) -> int:
    """Bits of a float (or complex part) of ``dtype`` that hold its value."""
    info = np.finfo(dtype)
    explicit_integer_bit = info.nmant == 63  # x87 extended precision stores it, IEEE does not
    return 1 + info.nexp + info.nmant + explicit_integer_bit


def _np_bytes(x: np.ndarray[Any, Any] | np.generic) -> bytes:
    """The bytes of ``x`` that hold its values: all of them, but for the padding of a native
    long double wider than its format (x86: 10 of every 16 bytes)."""
    a = np.asarray(x)
    if a.dtype.kind not in "fc" or not a.dtype.isnative or a.dtype.itemsize <= 8:
        return a.tobytes()
    part = a.dtype.itemsize // (2 if a.dtype.kind == "c" else 1)
    used = _value_bits(a.dtype) // 8
    if used == part:
        return a.tobytes()
    assert sys.byteorder == "little", "long double padding of a big-endian machine"
    parts = np.ascontiguousarray(a).view(np.uint8).reshape(-1, part)
    return parts[:, :used].tobytes()


def _tie_key(t: torch.Tensor) -> tuple[object, ...]:
    """Equal for tensors that are the same view of the same memory (a tied weight)."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return ("object", id(t))
    return (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Comparison:
    def __init__(self, same_objects: bool) -> None:
        self.same_objects = same_objects
        self.ties: dict[object, object] = {}  # expected's tie key -> actual's
        self.back: dict[object, object] = {}  # and back

    def check(self, a: object, b: object, path: str) -> None:
        where = path or "<root>"
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor)
            self.tensor(a, b, where)
        elif isinstance(a, dict):
            assert isinstance(b, dict)
            assert len(a) == len(b), f"{where}: {len(a)} keys vs {len(b)}: {list(a)} vs {list(b)}"
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
                self.check(ka, kb, f"{path}/<key {ka!r}>")
                self.check(va, vb, f"{path}/{ka!r}")
            assert hasattr(a, "_metadata") == hasattr(b, "_metadata"), f"{where}: _metadata"
            if hasattr(a, "_metadata"):
                self.check(a._metadata, b._metadata, f"{path}/<_metadata>")
        elif isinstance(a, list | tuple):
            assert isinstance(b, list | tuple)
            assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                self.check(x, y, f"{path}/{i}")
        elif isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray)
            assert (a.dtype.str, a.shape) == (b.dtype.str, b.shape), (
                f"{where}: {a.dtype.str}{a.shape} vs {b.dtype.str}{b.shape}"
            )
            assert _np_bytes(a) == _np_bytes(b), f"{where}: bytes differ"
        elif isinstance(a, np.generic):
            assert isinstance(b, np.generic)
            assert _np_bytes(a) == _np_bytes(b), f"{where}: {a!r} vs {b!r}"
        elif isinstance(a, float):
            assert isinstance(b, float)
            assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} vs {b!r}"
        else:
            assert a == b, f"{where}: {a!r} vs {b!r}"

    def tensor(self, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
        assert type(b) is torch.Tensor, f"{where}: {type(b).__name__}, not a plain tensor"
        assert b.device.type == "cpu", f"{where}: on {b.device}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert _raw(a) == _raw(b), f"{where}: bytes differ"
        if a.dtype not in _FP8 and not (a.is_floating_point() and a.isnan().any()):
            assert torch.equal(a.cpu(), b), where  # the values, as torch sees them
        key = _tie_key(a)
        key_b = id(b) if self.same_objects else _tie_key(b)
        assert self.ties.setdefault(key, key_b) == key_b, f"{where}: tie lost"
        assert self.back.setdefault(key_b, key) == key, f"{where}: spurious tie"


def assert_same_state(
    expected: object, actual: object, *, path: str = "", same_objects: bool = True
) -> None:
    """``actual`` is ``expected`` bit for bit (see the module docstring); ``path`` prefixes
    the location in failure messages (e.g. ``"step 3"``)."""
    _Comparison(same_objects).check(expected, actual, path)


def training_states(n: int) -> list[dict[str, Any]]:
    """``n`` consecutive checkpoints of a real model trained with AdamW, in mixed dtypes:
    fp32 weights and their bf16 copies, a frozen embedding (its chunks become references),
    optimizer and scheduler state, torch and Python RNG state, a step and a float loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64))
    frozen = nn.Embedding(512, 64)  # never trained: its chunks should become references
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    states = []
    for step in range(n):
        for _ in range(5):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        states.append(
            copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "frozen": frozen.state_dict(),
                    "half": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": torch.get_rng_state(),
                    "python_rng": random.getstate(),
                    "step": step,
                    "loss": loss.item(),
                }
            )
        )
    return states


def plain_dicts(state: Any) -> Any:
    """``state`` with OrderedDicts as dicts (a load assembles plain dicts)."""
    if isinstance(state, dict):
        return {k: plain_dicts(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_dicts(v) for v in state]
    return state
