"""The lossy archival tier (issue 23) measured: stored bytes against eval loss, and resume.

    .venv/bin/python bench/lossy.py [--quick] [--checkpoints N] [--threads T] [--runs ...]
        [--out bench/out] [--plot docs/img/lossy.png]
    .venv/bin/python bench/lossy.py --merge A/lossy.json B/lossy.json --out bench/out

Trains the fine-tune run and the GPT-from-scratch run of bench/models.py (fp32, AdamW, one
checkpoint every 25 steps), each with one param group and (``-2g``) with the two real
training scripts build (weight decay for matrices only: the optimizer's ids then follow the
groups, not the model; pairing uses the names a save with ``model=`` and ``optimizer=``
sends, and the JSON also records what the state alone pairs) and stores each run's chain of
checkpoints the way the service does with a lossy save: every tensor in chunks of 4 MiB (1M
fp32 elements); the chain's first checkpoint exactly; each later one against the previous
checkpoint *as it loads* (its reconstruction), with ``v_prev`` the reconstruction's
``exp_avg_sq``; the tensors :func:`ckptstore_core.lossy.pair_tensors` pairs through
:func:`ckptstore_core.lossy.encode` (lossless where it returns None) and every other tensor
through :func:`ckptstore_core.codec.encode_chunk` against the parent, as the service would.
For each setting of the sweep (:func:`settings`) it reports the stored bytes per checkpoint,
the ratio against the raw fp32 state (weights + both Adam moments; the checkpoints after the
chain's first), and the held-out loss of each reconstructed checkpoint against the
original's (% change). For the default parameters and for no weight pruning, each with lossy
and with exact moments, it also resumes training from the middle checkpoint as it loads to
the end of the run and compares the final held-out loss with the uninterrupted run's (a
resume from the exact checkpoint, first, must match it). An ExCP re-implementation
(bench/excp.py) runs beside it on the same checkpoints.

Results go to ``<out>/lossy.json`` and the plot (bench/lossy_plot.py: ratio against the worst
eval-loss change, ours against ExCP) to ``--plot``, where matplotlib is installed. The runs
can be measured in separate processes (``--runs NAME --out DIR`` each) and combined with
``--merge``. ``--quick``: tiny models, a smoke run of a few minutes. Full size: training
dominates (about 2 s per step on one busy core); use ``--threads 1`` on a loaded machine
(two OpenMP threads spinning on two shared cores slow down many times over).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import excp  # noqa: E402
import lossy_plot  # noqa: E402
import models  # noqa: E402
from ckptstore.state import dtype_to_wire, flatten, unflatten  # noqa: E402
from ckptstore_core import codec, lossy  # noqa: E402
from ckptstore_core.lossy import Lossy, Pair  # noqa: E402

#: the runs measured: bench/models.py's fp32 runs, and the same with the two param groups
#: real training scripts build (-2g: weight decay for matrices only, :func:`models.adamw`)
RUNS: dict[str, Callable[..., models.RunResult]] = {
    "finetune-fp32": models.run_finetune,
    "gpt-scratch-fp32": models.run_gpt_fp32,
    "finetune-fp32-2g": partial(models.run_finetune, groups=True),
    "gpt-scratch-fp32-2g": partial(models.run_gpt_fp32, groups=True),
}

CHUNK = 1 << 20  # elements per chunk: the service's default 4 MiB chunks of fp32
CHUNK_BYTES = 4 << 20
LEVEL = 1  # the service's default zstd level for lossless chunks
MB = 1e6

State = dict[str, Any]


@dataclass
class Flat:
    """A checkpoint as the service sees it: named tensors (fp32 as float32 arrays, others
    as their raw bytes) and the skeleton."""

    skeleton: str
    originals: dict[str, torch.Tensor]
    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]


def to_flat(state: State) -> Flat:
    fs = flatten(state)
    arrays, dtypes, originals = {}, {}, {}
    for name, t in fs.tensors:
        t = t.contiguous()
        originals[name] = t
        dtypes[name] = dtype_to_wire(t.dtype)
        if t.dtype == torch.float32:
            arrays[name] = t.reshape(-1).numpy()
        else:
            arrays[name] = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0)
    return Flat(fs.skeleton, originals, arrays, dtypes)


def to_state(flat: Flat, arrays: dict[str, np.ndarray]) -> State:
    tensors = {}
    for name, t in flat.originals.items():
        if flat.dtypes[name] == "F32":
            tensors[name] = torch.from_numpy(arrays[name].copy()).view(t.shape)
        else:
            tensors[name] = t
    out: State = unflatten(flat.skeleton, tensors)
    return out


def lossless_size(raw: np.ndarray, base: np.ndarray | None, itemsize: int) -> int:
    """Bytes the service stores for a tensor encoded losslessly against its parent."""
    data = raw.view(np.uint8)
    ref = None if base is None else base.view(np.uint8)
    step = codec.chunk_step(itemsize, CHUNK_BYTES)
    total = 0
    for k in range(0, max(len(data), 1), step):
        b = None if ref is None or len(ref) != len(data) else ref[k : k + step]
        total += codec.encode_chunk(data[k : k + step], b, itemsize, LEVEL).size
    return total


def itemsize(dtype: str) -> int:
    return {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2}.get(
        dtype, {"F16": 2, "BF16": 2, "I64": 8, "U64": 8, "F64": 8}.get(dtype, 4)
    )


def roles(pairs: list[Pair]) -> dict[str, tuple[lossy.Role, Pair]]:
    out: dict[str, tuple[lossy.Role, Pair]] = {}
    for p in pairs:
        out[p.weight] = ("weight", p)
        if p.exp_avg is not None and p.exp_avg_sq is not None:
            out[p.exp_avg] = ("exp_avg", p)
            out[p.exp_avg_sq] = ("exp_avg_sq", p)
    return out


# -- the two methods over a chain --------------------------------------------------------

Chain = Iterator[tuple[int, dict[str, np.ndarray]]]  # (stored bytes, reconstruction) per ckpt


def chain_ours(
    flats: list[Flat], pairs: list[Pair], params: Lossy, verify: bool, by_role: dict[str, int]
) -> Chain:
    """The service's lossy saves of checkpoints 1.. (0 stored exactly); ``by_role`` sums the
    stored bytes of weights, of each moment and of everything else."""
    by_name = roles(pairs)
    prev = dict(flats[0].arrays)
    for flat in flats[1:]:
        rec: dict[str, np.ndarray] = {}
        size = 0
        for name, raw in flat.arrays.items():
            role = by_name.get(name)
            if role is None or flat.dtypes[name] != "F32":
                n = lossless_size(raw, prev.get(name), itemsize(flat.dtypes[name]))
                size += n
                by_role["other"] = by_role.get("other", 0) + n
                rec[name] = raw
                continue
            kind, pair = role
            before = size
            out = np.empty_like(raw)
            vname = pair.exp_avg_sq
            for k in range(0, len(raw), CHUNK):
                r, b = raw[k : k + CHUNK], prev[name][k : k + CHUNK]
                v = None if vname is None else prev[vname][k : k + CHUNK]
                res = lossy.encode(kind, r, b, v, params)
                if res is None:
                    size += codec.encode_chunk(r, b, 4, LEVEL).size
                    out[k : k + CHUNK] = r
                    continue
                payload, recon = res
                if verify:
                    assert lossy.decode(payload, b, len(r)).tobytes() == recon.tobytes()
                size += len(payload)
                out[k : k + CHUNK] = recon
            by_role[kind] = by_role.get(kind, 0) + size - before
            rec[name] = out
        yield size, rec
        prev = rec


def chain_excp(flats: list[Flat], pairs: list[Pair], p: excp.ExCP) -> Chain:
    """ExCP (bench/excp.py) on checkpoints 1..: residuals against the previous original."""
    moments = {n for q in pairs for n in (q.exp_avg, q.exp_avg_sq) if n is not None}
    done = {q.weight for q in pairs} | moments
    prev_recon = dict(flats[0].arrays)
    prev_orig = flats[0].arrays
    for flat in flats[1:]:
        a = flat.arrays
        rec: dict[str, np.ndarray] = {}
        size = 0
        for q in pairs:
            m = a[q.exp_avg] if q.exp_avg is not None else None
            v = a[q.exp_avg_sq] if q.exp_avg_sq is not None else None
            s, w_rec, m_rec, v_rec = excp.encode_tensor(
                a[q.weight], prev_orig[q.weight], prev_recon[q.weight], m, v, p
            )
            size += s
            rec[q.weight] = w_rec
            if q.exp_avg is not None and q.exp_avg_sq is not None:
                assert m_rec is not None and v_rec is not None
                rec[q.exp_avg], rec[q.exp_avg_sq] = m_rec, v_rec
        for name, raw in a.items():
            if name not in done:
                size += lossless_size(raw, prev_orig.get(name), itemsize(flat.dtypes[name]))
                rec[name] = raw
        yield size, rec
        prev_recon, prev_orig = rec, a


# -- the sweep ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    method: str  # "ours" | "excp"
    label: str
    params: Lossy | excp.ExCP
    resume: bool = False


def _label(p: Lossy) -> str:
    quant = f" bits={p.bits}" if p.step is None else f" step={p.step:g}"
    return f"ours w={p.weight_prune:g} m={p.moment_prune:g}{quant}" + (
        " exact" if p.exact_moments else ""
    )


def settings(default: Lossy) -> list[Setting]:
    """The sweep: the uniform quantizer's step from fine to coarse with 80% to 99.9% of
    the moments pruned (the moments do not enter the eval loss: with no weight pruning they
    set the ratio and the resume only). Resumed from: the resume-safe preset
    (:data:`ckptstore_core.lossy.RESUMABLE`), a coarser step, the archival candidates.
    ExCP at the reference code's alpha and at stronger ones."""
    base = replace(default, weight_prune=0.0, exact_moments=False)
    grid = [  # (moment_prune, step, resumed)
        (0.8, 0.5, True),
        (0.8, 1.0, True),
        (0.95, 2.0, False),
        (0.99, 2.0, True),
        (0.999, 2.0, True),
        (0.999, 2.5, False),
        (0.999, 3.0, False),
    ]
    ours = [(replace(base, moment_prune=m, step=st), r) for m, st, r in grid]
    if all(p != default for p, _ in ours):
        ours.insert(0, (default, True))
    out = [Setting("ours", _label(p), p, resume=r) for p, r in ours]
    excp_grid = ((5e-5, 2.0), (2e-4, 2.0), (1e-3, 2.0))
    out += [Setting("excp", q.label(), q) for q in (excp.ExCP(a, b) for a, b in excp_grid)]
    return out


def measure_run(
    res: models.RunResult, default: Lossy, log: Callable[[str], None]
) -> dict[str, Any]:
    assert res.evaluate is not None and res.resume is not None
    evaluate, resume = res.evaluate, res.resume
    flats = [to_flat(state) for _, state in res.checkpoints]
    skeleton = json.loads(flats[0].skeleton)
    table = [(n, flats[0].dtypes[n], tuple(t.shape)) for n, t in flats[0].originals.items()]
    # paired as a save with model= and optimizer= pairs them (every weight, whatever the
    # param groups); the state alone, for the record
    pairing = lossy.pairing(table, skeleton, res.names)
    alone = lossy.pairing(table, skeleton).summary()
    pairs = pairing.pairs
    summary = pairing.summary()
    log(
        f"  paired with moments {summary['with_moments']}, without {summary['without_moments']}"
        f", left exact {summary['exact']} ({summary['layout']}); from the state alone "
        f"{alone['with_moments']} with moments, {alone['exact']} exact"
    )
    by_name = roles(pairs)
    moment_names = {n for n, (r, _) in by_name.items() if r != "weight"}
    # the raw fp32 state: every fp32 weight with Adam moments, and both moments
    raw_state = 4 * sum(len(a) for n, a in flats[0].arrays.items() if n in by_name)
    orig_eval = [evaluate(state) for _, state in res.checkpoints]
    mid = len(res.checkpoints) // 2
    t0 = time.perf_counter()
    final_state = res.resume(res.checkpoints[mid][1], res.gens[mid])
    sanity = evaluate(final_state)
    resume_s = time.perf_counter() - t0
    uninterrupted = evaluate(res.checkpoints[-1][1])
    log(
        f"  held-out loss {orig_eval[0]:.4f} -> {orig_eval[-1]:.4f}; resumed from the exact "
        f"step {res.checkpoints[mid][0]}: {sanity:.6f} vs uninterrupted {uninterrupted:.6f} "
        f"({resume_s:.0f} s)"
    )
    lossless_total = 0
    for t in range(1, len(flats)):
        for name, raw in flats[t].arrays.items():
            lossless_total += lossless_size(
                raw, flats[t - 1].arrays[name], itemsize(flats[t].dtypes[name])
            )
    lossless_per = lossless_total / (len(flats) - 1)
    log(
        f"  lossless chain: {lossless_per / MB:.2f} MB per checkpoint, "
        f"{raw_state / lossless_per:.2f}x"
    )
    out: dict[str, Any] = {
        "params": res.params,
        "steps": [s for s, _ in res.checkpoints],
        "raw_state_bytes": raw_state,
        "moment_tensors": len(moment_names),
        "pairing": summary,
        "pairing_state_alone": alone,
        "eval": orig_eval,
        "lossless_bytes_per_ckpt": lossless_per,
        "lossless_ratio": raw_state / lossless_per,
        "resume_from_step": res.checkpoints[mid][0],
        "uninterrupted_final_eval": uninterrupted,
        "resumed_exact_final_eval": sanity,
        "settings": [],
    }
    for s in settings(default):
        t0 = time.perf_counter()
        by_role: dict[str, int] = {}
        if s.method == "ours":
            assert isinstance(s.params, Lossy)
            chain = chain_ours(flats, pairs, s.params, s.params == default, by_role)
        else:
            assert isinstance(s.params, excp.ExCP)
            chain = chain_excp(flats, pairs, s.params)
        sizes, changes = [], []
        resumed = None
        for t, (size, rec) in enumerate(chain, start=1):
            sizes.append(size)
            state = to_state(flats[t], rec)
            changes.append(100 * (evaluate(state) / orig_eval[t] - 1))
            if s.resume and t == mid:
                final = evaluate(resume(state, res.gens[mid]))
                resumed = 100 * (final / uninterrupted - 1)
        per = sum(sizes) / len(sizes)
        row = {
            "method": s.method,
            "label": s.label,
            "params": s.params.to_json() if isinstance(s.params, Lossy) else vars(s.params),
            "stored_bytes_per_ckpt": sizes,
            "mean_stored_bytes": per,
            "ratio": raw_state / per,
            "stored_bytes_by_role": {k: v / len(sizes) for k, v in by_role.items()},
            "eval_change_pct": changes,
            "max_eval_change_pct": max(changes),
            "resume_final_change_pct": resumed,
            "seconds": time.perf_counter() - t0,
        }
        out["settings"].append(row)
        log(
            f"  {s.label:28s} {per / MB:7.3f} MB/ckpt {row['ratio']:7.1f}x  eval change "
            f"max {max(changes):+.3f}% mean {np.mean(changes):+.3f}%"
            + ("" if resumed is None else f"  resume final {resumed:+.3f}%")
            + f"  ({row['seconds']:.0f} s)"
        )
    return out


def merge(paths: list[Path], out: Path, plot: Path | None) -> None:
    """One lossy.json (and plot) of the runs in ``paths``, measured with the same settings."""
    docs = [json.loads(p.read_text()) for p in paths]
    merged = dict(docs[0], runs={})
    for doc in docs:
        same = {k: v for k, v in doc.items() if k != "runs"}
        if same != {k: v for k, v in docs[0].items() if k != "runs"}:
            raise SystemExit(f"not measured alike: {same} vs {docs[0]}")
        merged["runs"].update(doc["runs"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "lossy.json").write_text(json.dumps(merged, indent=1) + "\n")
    try:
        lossy_plot.plot(merged["runs"], plot or out / "lossy.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small models: a smoke run")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--plot", type=Path, default=None, help="default: <out>/lossy.png")
    p.add_argument("--checkpoints", type=int, default=None, help="per run (default 6: 5 measured)")
    p.add_argument("--every", type=int, default=25)
    p.add_argument(
        "--runs",
        nargs="+",
        choices=list(RUNS),
        default=list(RUNS),
        help="the runs; -2g: the same with two param groups",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 on a machine already busy)"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="measure nothing: combine the lossy.json files of runs measured apart "
        "(--runs NAME --out DIR) into <out>/lossy.json and the plot",
    )
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out, args.plot)
        return
    torch.set_num_threads(args.threads)
    size = models.SIZES["quick" if args.quick else "full"]
    n_ckpt = args.checkpoints or 6
    default = Lossy()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "quick": args.quick,
        "checkpoints_per_run": n_ckpt,
        "every": args.every,
        "chunk_elements": CHUNK,
        "default": default.to_json(),
        "runs": {},
    }
    for name in args.runs:
        log(f"{name}: training ({n_ckpt} checkpoints, one every {args.every} steps)")
        res = RUNS[name](size, n_ckpt, args.every, log)
        results["runs"][name] = measure_run(res, default, log)
        del res
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "lossy.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out}")
    try:
        lossy_plot.plot(results["runs"], args.plot or args.out / "lossy.png")
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plot")


if __name__ == "__main__":
    main()
