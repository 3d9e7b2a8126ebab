"""The soak (``bench/soak.py``, issue 21 item 8) for 45 seconds: two replicas on PostgreSQL +
S3 (moto) under 4 writers with retention, 2 readers, 2 slow clients, and a replica SIGKILLed
at random about every 20 s (45 s make a few hundred saves and 2 kills; the long soak is
``bench/soak.py --minutes 10``).

Guarantees checked, from the soak's JSON and its exit status: no load ever returned other
bytes than were saved; every request failed only in a way a retry fixes (a killed replica's
connection errors, a 503), never a 500 or a wrong 404, and no replica logged a missing blob,
corrupt data or a bug; after a last retention pass each run
lists exactly the committed steps its policy keeps, each bit-exact; after a collection as
with grace 0 the bucket holds exactly the blobs the catalog names; each slow client was cut
with 408 within its bound; no request waited longer than its documented bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
ALLOWED = {
    "connection",
    "503 storage_unavailable",
    "503 lock_lost",
    "503 too_many_uploads",
    "503 service_unavailable",
}


def test_a_short_soak(pg_url: str, s3_endpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SOAK), "--minutes", "0.75", "--kill-every", "20"]
    cmd += ["--database-url", pg_url, "--s3-endpoint", s3_endpoint]
    cmd += ["--data-dir", str(tmp_path / "data"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    log = f"{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
    assert out.exists(), log
    result = json.loads(out.read_text())

    assert done.returncode == 0 and result["passed"], (result["checks"], log)
    counts, final, store = result["counts"], result["final"], result["store"]
    # it did the work: saves and exact loads through both replicas, kills survived
    assert counts["saves"] >= 40 and counts["loads_exact"] >= 40, counts
    assert counts.get("wrong_bytes", 0) == 0 and final["wrong"] == 0
    assert len(result["kills"]) >= 1, result["kills"]
    # every retained checkpoint was loaded, and nothing is orphaned or missing
    assert final["kept"] >= 10, final
    assert store["orphan_count"] == store["missing_count"] == store["open_uploads"] == 0, store
    assert store["writing_rows_left"] == 0, store
    # errors only of the retriable kinds
    kinds = {key.split(": ", 1)[1] for key in result["errors"]}
    assert kinds <= ALLOWED, result["errors"]
    assert not result["disallowed_errors"] and not result["failures"], result["failures"]
    # every connection error came from a kill of its replica (not a response cut short by
    # the service), and no replica logged missing or corrupt data or a bug
    assert result["unexplained_connection_errors"]["count"] == 0, result[
        "unexplained_connection_errors"
    ]
    assert result["checks"]["no_data_errors_logged"], result["log_errors"]
    # every request kind within its bound; the slow clients were cut (408) each time
    latency = result["latency"]
    assert all(x["within"] for x in latency.values()), latency
    for kind in ("slow_silent", "slow_stall", "slow_trickle"):
        cut = latency[kind]["count"] - sum(latency[kind]["errors"].values())
        assert cut >= 1, (kind, latency[kind])
    # the replicas' memory was sampled (its slope is printed; 2 minutes are too short to judge)
    assert all(r["samples"] >= 10 for r in result["rss"].values()), result["rss"]
