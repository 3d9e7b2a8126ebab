"""Real training states other than AdamW round-trip bit-exactly through a real service.

``test_resume.py`` covers AdamW + a cosine schedule and ``tests/unit/test_state.py`` the
skeleton in-process; here optimizers, schedulers, the AMP grad scaler and awkward keys and
leaves go through a real uvicorn service, a real database and the wire parser, each compared
value by value (tensors byte by byte, floats bit by bit, container and key types exactly).
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointClient
from support.serviceproc import Service
from support.states import assert_same_state


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def trained(make: Callable[[Any], torch.optim.Optimizer], closure: bool = False) -> object:
    model = mlp()
    opt = make(model.parameters())
    for _ in range(3):

        def loss() -> torch.Tensor:
            opt.zero_grad()
            value = model(torch.randn(5, 8)).square().mean()
            value.backward()
            return value

        if closure:
            opt.step(loss)
        else:
            loss()
            opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


OPTIMIZERS: dict[str, Callable[[], object]] = {
    "sgd-nesterov": lambda: trained(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)
    ),
    "sgd-no-momentum": lambda: trained(lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": lambda: trained(lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "rmsprop-centered": lambda: trained(
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True)
    ),
    "adam-amsgrad": lambda: trained(lambda p: torch.optim.Adam(p, amsgrad=True)),
    "asgd": lambda: trained(lambda p: torch.optim.ASGD(p)),
    "rprop": lambda: trained(lambda p: torch.optim.Rprop(p)),
    # lists of tensors, ints and a float loss in the state
    "lbfgs": lambda: trained(
        lambda p: torch.optim.LBFGS(p, history_size=3, max_iter=5), closure=True
    ),
}


def sgd_with_none_buffers() -> object:
    sd = torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9).state_dict()
    sd["state"] = {0: {"momentum_buffer": None}, 1: {"momentum_buffer": torch.zeros(16, 8)}}
    return sd


def schedulers() -> dict[str, object]:
    sched = torch.optim.lr_scheduler
    out: dict[str, object] = {}

    def opt() -> torch.optim.Optimizer:
        return torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9)

    def stepped(s: Any, n: int = 3) -> object:
        for _ in range(n):
            s.optimizer.step()
            s.step()
        return s.state_dict()

    out["lambda"] = stepped(sched.LambdaLR(opt(), lambda e: 0.95**e))
    out["onecycle"] = stepped(sched.OneCycleLR(opt(), max_lr=0.5, total_steps=100))
    plateau = sched.ReduceLROnPlateau(opt())
    out["plateau-fresh"] = plateau.state_dict()  # best and mode_worse: inf
    plateau.step(float("nan"))
    out["plateau"] = plateau.state_dict()
    o = opt()
    out["sequential"] = stepped(
        sched.SequentialLR(
            o, [sched.LinearLR(o, 0.1, total_iters=5), sched.CosineAnnealingLR(o, 10)], [5]
        ),
        7,
    )
    out["cyclic"] = stepped(sched.CyclicLR(opt(), 0.01, 0.1))
    out["warm-restarts"] = stepped(sched.CosineAnnealingWarmRestarts(opt(), 3), 4)
    out["multistep"] = stepped(sched.MultiStepLR(opt(), [2, 5, 5]))  # milestones: a Counter
    return out


def leaves() -> dict[object, object]:
    w = torch.randn(4, 4)
    return {
        "a/b": torch.ones(2),
        "~0": 1,
        "ü∂": torch.zeros(1),
        3: "int key",
        None: "None key",
        True: "bool key",
        1.5: "float key",
        -1.5: "negative float key",
        "0": torch.ones(1),
        0: torch.zeros(1),
        "": torch.full((2,), 7.0),  # the root key "" names its tensor ""
        "__metadata__": torch.arange(2),  # safetensors' reserved name
        "nul\x00key": torch.arange(3),  # PostgreSQL text cannot hold NUL
        "nested": {"x": {"y": {}}, "l": [[], [{}], ()]},
        "tuple": (1, [2], (3,)),
        "odict": OrderedDict([("z", 1), ("a", 2)]),
        "counter": Counter({5: 2, 2: 1}),
        "ints": [2**53 + 1, -(2**64) - 1, 2**200, 0, -1],
        "floats": [0.1, -0.0, math.inf, -math.inf, math.nan, 5e-324],
        "tied": [w, w.view(4, 4), w.T],
        "views": {"slice": w[1:3, ::2], "0d": torch.tensor(2.5), "empty": torch.empty(0, 3)},
        "dtypes": {
            str(dt): torch.arange(6).to(dt)
            for dt in (torch.bool, torch.int8, torch.uint16, torch.float16, torch.bfloat16)
        },
        "fp8": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "rng": {"torch": torch.get_rng_state(), "py": random.getstate()},
    }


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def client(
    request: pytest.FixtureRequest, make_service: Callable[..., Service]
) -> Iterator[CheckpointClient]:
    env = None
    if request.param == "postgres":
        env = {"CKPTSTORE_DATABASE_URL": request.getfixturevalue("pg_url")}
    with CheckpointClient(make_service(env).url, retries=0) as c:
        yield c


def roundtrip(client: CheckpointClient, run: str, state: object) -> Any:
    client.save(run, 1, state)
    back = client.load(run, 1)
    assert_same_state(state, back)
    return back


def test_optimizer_scheduler_and_scaler_states(client: CheckpointClient) -> None:
    for name, make in OPTIMIZERS.items():
        roundtrip(client, f"optim-{name}", make())
    roundtrip(client, "optim-sgd-none", sgd_with_none_buffers())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    roundtrip(client, "scaler", {"scaler": scaler.state_dict()})
    states = schedulers()
    for name, state in states.items():
        roundtrip(client, f"sched-{name}", {"sched": state})
    # and the scheduler that holds a Counter resumes from it
    back = client.load("sched-multistep", 1)["sched"]
    fresh = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(mlp().parameters(), lr=0.1), [1])
    fresh.load_state_dict(back)
    assert fresh.milestones == Counter({5: 2, 2: 1})


def test_awkward_keys_and_leaves(client: CheckpointClient) -> None:
    state = leaves()
    back = roundtrip(client, "leaves", state)
    assert back["tied"][0] is back["tied"][1]
    assert back["tied"][2] is not back["tied"][0]
    roundtrip(client, "root-tensor", torch.arange(5.0))
    roundtrip(client, "root-tuple", (torch.ones(2), {"": torch.zeros(1)}))
    # the next save of the run is a delta against the first one, and both still load
    state[""] = torch.full((2,), 8.0)
    client.save("leaves", 2, state)
    assert_same_state(state, client.load("leaves"))
    assert_same_state(leaves()["counter"], client.load("leaves", 1)["counter"])


def test_prefix_load_of_a_tensor_tied_outside_the_prefix(
    make_service: Callable[..., Service],
) -> None:
    # A tied embedding: the head is the embedding, which travels under its first name
    # (model/wte.weight), outside the prefix; the client fetches it from the step it was
    # served, so a save that lands in between does not mix two checkpoints.
    emb = torch.randn(10, 4)
    state = {"model": {"wte.weight": emb, "lm_head.weight": emb, "ln.bias": torch.zeros(4)}}
    with CheckpointClient(make_service().url, retries=0) as client:
        client.save("tied-prefix", 1, state)
        back = client.load("tied-prefix", prefix="model/lm_head")
        assert_same_state({"model": {"lm_head.weight": emb}}, back)
        newer = {"model": {"wte.weight": emb + 1, "lm_head.weight": emb + 1}}
        client.save("tied-prefix", 2, newer)
        assert_same_state(
            {"model": {"lm_head.weight": emb}},
            client.load("tied-prefix", 1, prefix="model/lm_head"),
        )
        back = client.load("tied-prefix", prefix="model/lm")
        assert_same_state({"model": {"lm_head.weight": emb + 1}}, back)
        both = client.load("tied-prefix", 1, prefix="model/")
        assert both["model"]["lm_head.weight"] is both["model"]["wte.weight"]
