"""tools/scale_bench.py: the fit and the extrapolation, the table, the docs' section, and one real run of a toy path
through the subprocess protocol (a few seconds)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from tools.scale_bench import (
    BEGIN,
    END,
    MEMORY_FLOOR,
    REGISTRY,
    ROWS,
    Result,
    ScalePath,
    counters_lines,
    extrapolate,
    fit_exponent,
    main,
    render_table,
    replace_section,
    verdict,
)


@pytest.mark.parametrize("k", [0.0, 0.5, 1.0, 2.0, -0.3])
def test_fit_gives_a_power_law_its_exponent(k):
    sizes = [10**6, 10**7, 10**8]
    assert fit_exponent(sizes, [3.0 * s**k for s in sizes]) == pytest.approx(k, abs=1e-9)
    assert fit_exponent([2_000, 10_000, 30_000], [7e-3 * s**k for s in (2_000, 10_000, 30_000)]) == pytest.approx(k)


def test_fit_is_least_squares_and_floors_small_values():
    # log10 values 0, 1.2, 2 over log10 sizes 0, 1, 2: the least-squares slope is (2 - 0) / 2 = 1 (the middle's
    # excess has no lever), not either segment's 1.2 or 0.8
    assert fit_exponent([1, 10, 100], [1, 10**1.2, 100]) == pytest.approx(1.0)
    # below the floor everywhere: flat, whatever the noise
    assert fit_exponent([1, 10, 100], [3e5, 1e3, 9e5], floor=MEMORY_FLOOR) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        fit_exponent([5], [1.0])
    with pytest.raises(ValueError):
        fit_exponent([5, 5], [1.0, 2.0])


def test_extrapolation_follows_the_exponent_from_the_largest_point():
    assert extrapolate(10**8, 7.0, 10**10, 1.0) == pytest.approx(700.0)
    assert extrapolate(100, 2.0, 400, 0.5) == pytest.approx(4.0)
    assert extrapolate(100, 2.0, 10**6, -0.4) == 2.0  # shrinking costs are held, not extrapolated down
    # a quadratic path measured at 1e6..1e8 and taken to the advertised rows
    sizes = [10**6, 10**7, 10**8]
    values = [1e-12 * s**2 for s in sizes]
    k = fit_exponent(sizes, values)
    assert extrapolate(sizes[-1], values[-1], ROWS, k) == pytest.approx(1e-12 * ROWS**2)


def test_verdict():
    assert verdict(0.05, 0.19) == "bounded"
    assert verdict(1.0, 0.0) == "time grows as size^1.00; memory bounded"
    assert verdict(0.1, 0.98) == "time bounded; memory grows as size^0.98"


def path(name="p", target=10**4):
    return ScalePath(name, "m:f", (10, 100, 1000), (1, 2, 3), "rows", target, "test", "rank")


def test_table():
    linear = Result(path("linear"), (10, 100, 1000), 10**4, [
        {"status": "ok", "size": s, "seconds": s * 1e-3, "rss_growth": s * 2**20, "counters": {}}
        for s in (10, 100, 1000)])
    flat = Result(path("flat"), (10, 100, 1000), 10**4, [
        {"status": "ok", "size": s, "seconds": 2e-4, "rss_growth": 4096, "counters": {}} for s in (10, 100, 1000)])
    missing = Result(path("missing"), (10, 100, 1000), 10**4,
                     [{"status": "not available", "size": 10, "error": "no module tools.x"}])
    table = render_table([linear, flat, missing]).splitlines()
    assert len(table) == 5 and table[1] == "|" + "---|" * 11
    assert all(line.startswith("| ") and line.endswith(" |") for line in table[:1] + table[2:])
    assert all(line.count(" | ") == table[0].count(" | ") for line in table[2:])  # one cell per column
    assert "| `linear` | 10 / 100 / 1,000 (rows) | rank | 10.0 ms / 100.0 ms / 1.00 s | 10.0 MiB / 100 MiB / 1,000 MiB" \
        " | 1.00 | 1.00 | 10,000 | 10.00 s | 9.77 GiB | time grows as size^1.00; memory grows as size^1.00 |" == table[2]
    assert "bounded (< 1 ms)" in table[3] and "bounded (< 1 MiB)" in table[3] and table[3].endswith("| bounded |")
    assert table[4].endswith("| not available: no module tools.x |")
    linear.points[0]["counters"] = {"stats": 3}
    linear.points[2]["counters"] = {"stats": 30_000, "bytes_read": 4096}
    assert counters_lines([linear, flat, missing]) == [
        "- `linear` at 10 / 100 / 1,000: stats 3 / - / 30,000; bytes_read - / - / 4,096"]


DOC = """# Performance

## Start-up

Text.\r\nwith a CR LF line.

## Scale

What is measured, by hand.

{begin}
Not measured yet.
{end}

Why a cost grows, by hand.

## Compile on CPU (`model.compile`)

More text.
"""


def test_write_replaces_only_the_generated_part_of_the_section():
    doc = DOC.format(begin=BEGIN, end=END)
    out = replace_section(doc, "| a | b |\n|---|---|\n")
    before, after = doc.split(BEGIN)[0], doc.split(END)[1]
    assert out == before + BEGIN + "\n| a | b |\n|---|---|\n" + END + after
    assert replace_section(out, "Not measured yet.\n") == doc  # and back, byte for byte


def test_write_without_markers_replaces_the_whole_section_and_adds_them():
    doc = DOC.format(begin="", end="")
    out = replace_section(doc, "table\n")
    head, rest = doc.split("## Scale\n")
    assert out.startswith(head + "## Scale\n\n" + BEGIN + "\ntable\n" + END + "\n\n## Compile on CPU")
    assert out.endswith(rest[rest.index("## Compile"):])
    # no Scale section at all: appended
    assert replace_section("# P\n\n## A\n\nx\n", "t\n") == f"# P\n\n## A\n\nx\n\n## Scale\n\n{BEGIN}\nt\n{END}\n"
    # the last section of the file
    assert replace_section("## A\n\n## Scale\n\nold\n", "t\n") == f"## A\n\n## Scale\n\n{BEGIN}\nt\n{END}\n"


def test_registry_targets_and_sizes():
    names = [p.name for p in REGISTRY]
    assert len(names) == len(set(names))
    for p in REGISTRY:
        assert len(p.sizes) == 3 and len(p.quick) == 3 and list(p.sizes) == sorted(p.sizes), p.name
        assert p.target >= max(p.sizes) and ":" in p.function and p.per and p.derivation, p.name
    by_name = {p.name: p for p in REGISTRY}
    assert by_name["order"].target == 15 * 10**12 // 4096 and by_name["store-open"].target == 100_000
    assert by_name["order-numpy-permutation"].baseline and not by_name["order"].baseline


TOY = '''
import numpy as np

def alloc(size, workdir):
    """size bytes, touched (calloc'd zero pages would not count)."""
    block = np.ones(size, dtype=np.uint8)
    with open(workdir / "calls", "a") as f:
        f.write("call\\n")
    return {"bytes": int(block.sum())}

def prepare_alloc(size, workdir):
    (workdir / "input").write_bytes(b"x" * 16)

def broken(size, workdir):
    raise RuntimeError("the toy path failed")
'''


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="the peak RSS of the child alone is Linux's VmHWM")
def test_end_to_end_quick_run_of_a_toy_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "scale_toy.py").write_text(textwrap.dedent(TOY))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    doc = tmp_path / "performance.md"
    doc.write_text(DOC.format(begin=BEGIN, end=END))
    mib = 2**20
    code = main(["--quick", "--paths", "toy,missing,broken", "--add", "toy=scale_toy:alloc",
                 "--sizes", f"toy={8 * mib},{16 * mib},{32 * mib}", "--target", f"toy={128 * mib}",
                 "--add", "missing=scale_no_such_module:f", "--sizes", "missing=1,2,3",
                 "--add", "broken=scale_toy:broken", "--sizes", "broken=1,2,3",
                 "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "out.json"), "--warm",
                 "--write", "--doc", str(doc)])
    out = capsys.readouterr().out
    assert code == 1  # the broken path failed; the others were still measured and written
    rows = {r["path"]: r for r in json.loads((tmp_path / "out.json").read_text())}
    toy = rows["toy"]
    assert [p["size"] for p in toy["points"]] == [8 * mib, 16 * mib, 32 * mib]
    for point in toy["points"]:  # the toy holds its size: the growth is that, within the allocator's slack
        assert point["status"] == "ok" and point["counters"] == {"bytes": point["size"]}
        assert 0.9 * point["size"] <= point["rss_growth"] <= 1.25 * point["size"] + 2 * mib, point
    assert toy["k_memory"] == pytest.approx(1.0, abs=0.15)
    assert toy["memory_at_target"] == pytest.approx(128 * mib, rel=0.3)
    assert (tmp_path / "work" / "toy" / str(8 * mib) / "input").is_file()  # prepare_alloc ran
    assert (tmp_path / "work" / "toy" / str(8 * mib) / "calls").read_text() == "call\n" * 2  # --warm's, measured
    assert rows["missing"]["points"][0]["status"] == "not available"
    assert rows["broken"]["points"][0]["status"] == "failed"
    assert "RuntimeError: the toy path failed" in rows["broken"]["points"][0]["error"]
    assert "| not available: no module scale_no_such_module |" in out
    written = doc.read_bytes().decode()  # the file's own bytes: its CR LF line kept
    assert written.split(BEGIN)[0] == DOC.split("{begin}")[0]
    assert written.split(END)[1] == DOC.split("{end}")[1]
    assert "| `toy` |" in written and "python tools/scale_bench.py --quick --paths toy,missing,broken" in written
    assert math.isfinite(toy["k_time"])
