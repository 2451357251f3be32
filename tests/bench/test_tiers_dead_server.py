"""``kvmgr bench tiers --url`` / ``--cluster-url`` of a server that accepts no connection: one
line on stderr and exit status 2, before anything runs (newuser16; before, the floor client's
``ConnectionRefusedError`` traceback, exit 1)."""

from __future__ import annotations

import socket

import pytest

from kvmgr import cli


def _dead_port() -> int:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--url", "redis://:secret@127.0.0.1:{port}/0", "--sections", "shared"], "--url"),
        (["--url", "redis+cluster://127.0.0.1:{port},127.0.0.1:{port}"], "--url"),
        (["--url", "unix:///nonexistent/kvmgr.sock", "--sections", "shared"], "--url"),
        (
            [
                "--sections",
                "cluster",
                "--url",
                "redis://127.0.0.1:{live}",
                "--cluster-url",
                "redis+cluster://127.0.0.1:{port}",
            ],
            "--cluster-url",
        ),
    ],
)
def test_a_dead_server_is_one_line_and_exit_2(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _dead_port()
    argv = ["bench", "tiers", "--batches", "1", "--rounds", "1", "--cases", "4k48"]
    with socket.create_server(("127.0.0.1", 0)) as live:  # accepts: the --url that is up
        up = str(live.getsockname()[1])
        given = [a.replace("{port}", str(port)).replace("{live}", up) for a in args]
        status = cli.main(argv + given)
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith(f"kvmgr bench tiers: {flag} ")
    assert "no server accepts connections" in err and "Traceback" not in err
    assert "secret" not in err  # the URL's password is never shown
