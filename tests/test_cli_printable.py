"""Names from data reach the terminal as visible text: control characters (C0, C1, DEL),
bidirectional overrides and rich markup in POSIX names and tensor names are escaped by one
helper (``fmstore.cli.util.printable``) in ``ls``, ``du``, ``ckpt inspect`` and the one
``error:`` line; the CLI runs in a subprocess, on a real POSIX tier.  Output piped to a file is not wrapped at 80 columns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fmstore.cli.util import printable

#: hides a name, retitles the terminal (and eats what follows), fakes a summary line,
#: reverses what follows, a C1 CSI, DEL, markup
HOSTILE = [
    "a\x1b[8mhidden\x1b[0m",
    "c\x1b]0;title\x07",
    "b\r\n1 object, 1 B",
    "d\u202etxt.exe",
    "e\x9b31mx\x7f",
    "[red]f",
]
BIDI = {chr(c) for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def raw_controls(text: str) -> list[str]:
    """Characters a terminal acts on: C0 but the newline, DEL, C1, bidirectional controls."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c in BIDI]


def test_printable_escapes_controls_visibly_and_markup_only_where_asked():
    assert printable("a\x1b[8mb\r\n\u202e\x9b\x7f\x00\U000e0001") == (
        "a\\x1b[8mb\\r\\n\\u202e\\x9b\\x7f\\x00\\U000e0001"
    )
    assert printable("[red]x[/red]") == "\\[red]x\\[/red]"
    assert printable("[red]x\t", markup=False) == "[red]x\\t"
    assert printable("ok näme 日本 ü/ß") == "ok näme 日本 ü/ß"  # printable text as it is
    assert printable(7) == "7"


def run_cli(commands: list[list[str]]) -> list[tuple[str, str]]:
    """Each command's stdout and stderr, from one process running the CLI's entry point."""
    probe = (
        "import sys, json\n"
        "from fmstore.cli.main import main\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    sys.stdout.write('\\n=====\\n'); sys.stdout.flush()\n"
        "    sys.stderr.write('\\n=====\\n'); sys.stderr.flush()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(commands)],
        capture_output=True,
        timeout=120,
        env={**__import__("os").environ, "COLUMNS": "300"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    outs = r.stdout.decode().split("\n=====\n")
    errs = r.stderr.decode().split("\n=====\n")
    return list(zip(outs, errs, strict=False))[: len(commands)]


@pytest.fixture
def hostile_tier(posix_cfg, tmp_path):
    import torch

    import fmstore

    nvme = tmp_path / "nvme"
    (nvme / "files").mkdir(parents=True)
    for name in HOSTILE:
        (nvme / "files" / name).write_bytes(b"x")
    fmstore.save({name: torch.ones(2) for name in HOSTILE}, str(nvme / "ck"))
    torch.save({name: torch.ones(2) for name in HOSTILE}, str(nvme / "model.pt"))
    return nvme


def test_no_name_from_data_reaches_the_terminal_raw(hostile_tier):
    got = run_cli(
        [
            ["ls", "nvme:files"],
            ["ls", "-l", "nvme:files"],
            ["du", "nvme:files"],
            ["ckpt", "inspect", "nvme:ck"],
            ["ckpt", "inspect", "nvme:model.pt"],
            ["ls", "nvme:files/z\x1b]0;t\x07gone"],
        ]
    )
    for (out, err), what in zip(got, ("ls", "ls -l", "du", "inspect", "inspect .pt", "error")):
        assert raw_controls(out) == [] and raw_controls(err) == [], (what, out, err)
    ls, ls_l, du, inspect, inspect_pt, error = got
    for out in (ls[0], ls_l[0], du[0], inspect[0], inspect_pt[0]):
        assert "a\\x1b[8mhidden\\x1b[0m" in out and "d\\u202etxt.exe" in out, out
        assert "[red]f" in out, out  # markup shown as text, not a colour
    # one summary line: the name's CR/LF shows as text, not as a line of its own
    lines = ls[0].splitlines()
    assert len(lines) == len(HOSTILE) + 1 and "b\\r\\n1 object, 1 B" in lines, lines
    assert lines[-1] == "6 objects, 6 B", lines
    assert error[1].startswith("error: ") and error[1].count("\n") <= 1, error


def test_output_piped_to_a_file_is_not_wrapped_at_80_columns(tmp_path):
    import os

    name = "very_long_file_name_" * 5 + "x.bin"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / name).write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with open(tmp_path / "out.txt", "w") as out:
        subprocess.run(
            [sys.executable, "-m", "fmstore", "ls", "-l", str(tmp_path / "d")],
            stdout=out,
            env=env,
            check=True,
            timeout=120,
        )
    text = (tmp_path / "out.txt").read_text()
    assert any(name in line and "1 B" in line for line in text.splitlines()), text
