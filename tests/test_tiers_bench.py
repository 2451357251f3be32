"""``kvmgr bench tiers`` runs end to end on a tiny size (its figures are not asserted)."""

from __future__ import annotations

import json

import pytest
from tiers_server import server_binary

from kvmgr.cli import main


def test_bench_tiers_smoke(tmp_path, capsys) -> None:
    pytest.importorskip("redis")
    server_binary()  # skip (or fail in CI) without a server
    out = tmp_path / "tiers.json"
    status = main(["bench", "tiers", "--steps", "2", "--batch-mib", "1", "--disk-dir",
                   str(tmp_path), "--json", str(out)])  # fmt: skip
    assert status == 0  # 0 = every loaded byte equal to the stored one
    rows = json.loads(out.read_text())
    assert {(r["case"], r["tier"].split()[0], r["direction"]) for r in rows} == {
        (c, t, d) for c in ("4k48", "32k64") for t in ("disk", "shared") for d in ("store", "load")
    }
    assert all(r["gbps"] > 0 and "ratio" in r for r in rows)
    assert "kvmgr bench tiers" in capsys.readouterr().out
    assert not list(tmp_path.glob("kvmgr-bench-tiers-*"))  # temporary files removed
