"""README's headline figures are generated from benchmarks/RESULTS.md, never typed."""

from __future__ import annotations

from benchmarks import readme

RESULTS = """# Benchmark results

## checkpoint

### checkpoint

| size | group | what | s | vs floor | vs torch.save |
|------|-------|------|---|----------|---------------|
| 1 GiB | sync save | fmstore.save compression=raw | 1.00 | 0.84 | 1.08 |

## dcp

### DCP, 2 ranks, 2048 MiB total

| tier | method | save x peer | load x peer | stall / peer |
|------|--------|-------------|-------------|--------------|
| s3 | fmstore | 1.06 | 1.36 | |
| posix | fmstore | 1.49 | 1.37 | 0.13 |

### DCP, 2 ranks, 2048 MiB total (again)

| tier | method | save x peer | load x peer | stall / peer |
|------|--------|-------------|-------------|--------------|
| posix | fmstore | 1.33 | 1.09 | 0.11 |
| s3 | fmstore | 1.21 | 2.33 | |
"""


def _line(block: str, what: str) -> str:
    return next(ln for ln in block.splitlines() if ln.startswith(f"| {what} |"))


def test_readme_block_matches_current_results():
    # Fails when a figure in README.md was edited by hand or RESULTS.md changed without
    # `python -m benchmarks.readme`.
    assert readme.main(["--check"]) == 0


def test_figures_come_from_the_results_text():
    block = readme.render(RESULTS)
    assert _line(block, "checkpoint sync save vs O_DIRECT floor / vs torch.save").endswith(
        "| 0.84× / 1.08× |"
    )
    # Several runs give a range; "newest run" rows read the last table only.
    posix = _line(block, "DCP save / load / async stall vs FileSystemWriter / Reader (POSIX)")
    assert posix.endswith("| 1.33–1.49× / 1.09–1.37× / 0.11–0.13× |")
    s3 = _line(block, "DCP save / load on S3 vs s3torchconnector (newest run)")
    assert s3.endswith("| 1.21× / 2.33× |")
    # What the results do not hold is shown as missing, not carried over.
    assert _line(block, "S3Store upload / download vs boto3 (1 and 16 objects)").endswith(
        "| — / — |"
    )


def test_rewrite_replaces_only_the_marked_block():
    text = f"intro\n{readme.BEGIN}\nold | 9.99×\n{readme.END}\noutro\n"
    out = readme.rewrite(text, readme.render(RESULTS))
    assert out.startswith("intro\n") and out.endswith("\noutro\n") and "9.99" not in out


def test_a_range_names_its_unit_once():
    rows = [{"what": "w", "v": "1250"}, {"what": "w", "v": "1355"}]
    results = {"s": [("t", rows)]}
    fig = readme.Fig("s", "t", {"what": "w"}, "v", fmt="{:.0f} MB/s")
    assert readme.render_fig(results, fig) == "1250–1355 MB/s"
    seconds = readme.Fig("s", "t", {"what": "w"}, "v", fmt="{:.2f} s")
    assert (
        readme.render_fig(
            {"s": [("t", [{"what": "w", "v": "0.09"}, {"what": "w", "v": "0.1"}])]}, seconds
        )
        == "0.09–0.10 s"
    )
    assert (
        readme.render_fig(results, readme.Fig("s", "t", {"what": "w"}, "v")) == "1250.00–1355.00×"
    )


def test_the_checkpoint_benchmark_writes_the_size_it_names():
    from benchmarks.checkpoint import make_state, nbytes_of, parse_size

    for size in ("128MiB", "300MiB"):
        got = nbytes_of(make_state(parse_size(size)))
        assert abs(got - parse_size(size)) / parse_size(size) < 0.01, (size, got)
