"""``kvmgr bench tiers`` runs end to end on a tiny size (its figures are not asserted): every
section (shared vs the floor client, cluster vs one server, disk vs fio) gives its rows and
ratios, and the loaded bytes equal the stored ones."""

from __future__ import annotations

import json
import shutil

import pytest
from tiers_server import server_binary

from kvmgr.cli import main


def test_bench_tiers_smoke(tmp_path, capsys) -> None:
    server_binary()  # skip (or fail in CI) without a server
    out = tmp_path / "tiers.json"
    status = main(["bench", "tiers", "--batches", "1", "2", "--rounds", "1", "--disk-dir",
                   str(tmp_path), "--json", str(out), "--cluster-primaries", "2"])  # fmt: skip
    assert status == 0  # 0 = every loaded byte equal to the stored one
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["case"], r["tier"].split()[0], r["direction"], r["batch_blocks"]) for r in rows} == {
        (c, t, d, b)
        for c in ("4k48", "32k64")
        for t in ("shared", "cluster", "disk")
        for d in ("store", "load")
        for b in (1, 2)
    }
    have_fio = shutil.which("fio") is not None
    for r in rows:
        assert r["gbps"] > 0
        assert ("ratio" in r) == (have_fio or not r["tier"].startswith("disk"))
    assert report["machine"]["cpus"] >= 1
    assert "kvmgr bench tiers" in capsys.readouterr().out
    assert not list(tmp_path.glob("kvmgr-bench-tiers-*"))  # temporary files removed


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (apt-get install fio)")
def test_bench_tiers_has_fio_in_ci() -> None:
    """CI installs fio (.ci/run): the disk ratio is measured there."""
    assert shutil.which("fio")
