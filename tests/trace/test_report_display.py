"""How a report shows itself: one-line repr, HTML for notebooks, rich, text, and its plot."""

import gc
import warnings

import numpy as np
import pytest

import ringflow as rf

MB = 10**6


@pytest.fixture(scope="module")
def rep():
    dev = rf.device("sim", profile="unit")

    def f(x, y):
        y[:] = x * 2 + 1

    f.sim_seconds = 0.5e-3
    items = [np.full(MB // 4, i + 1, np.float32) for i in range(6)]
    with rf.Pipeline(f, device=dev, chunk_bytes=MB, workers=2, profile=True, slots=3) as pipe:
        list(pipe.map(items))
    return pipe.report()


def test_repr_is_one_short_line_with_the_headline_figures(rep):
    text = repr(rep)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("<Report ") and text.endswith(">")
    assert "6 chunks" in text
    assert f"{rep.measured_s * 1e3:.3f} ms" in text
    assert f"bottleneck {rep.bottleneck}" in text
    assert f"efficiency {rep.efficiency:.2f}" in text


def test_html_is_a_small_table_of_the_figures_that_matter(rep):
    html = rep._repr_html_()
    assert html.lstrip().startswith("<") and html.count("<table") == 1 and len(html) < 6000
    for stage in ("prepare", "h2d", "compute", "d2h", "consume"):
        assert f"<td>{stage}</td>" in html
    for label in ("bottleneck", "ideal bound", "efficiency", "latency p50", "latency p99"):
        assert label in html
    assert f"{rep.ideal_s * 1e3:.3f}" in html and f"{rep.efficiency:.2f}" in html
    assert f"{rep.latency_s['p99'] * 1e3:.3f}" in html
    assert f"{rep.stage_median_s['compute'] * 1e3:.4f}" in html


def test_html_escapes_what_it_shows(rep):
    import dataclasses

    odd = dataclasses.replace(rep, bottleneck="<script>x</script>")
    html = odd._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_rich_renders_the_table(rep):
    from rich.console import Console

    console = Console(width=100, record=True, file=__import__("io").StringIO())
    console.print(rep)
    text = console.export_text()
    assert "efficiency" in text and "h2d" in text and "latency p50/p95/p99" in text
    assert "<Report" not in text  # rendered as the table, not as its repr


def test_str_is_the_table_and_leaks_no_file():
    """``str`` renders through rich; a console writing to a file it never closes would show
    up as a ResourceWarning once collected."""
    dev = rf.device("sim", profile="unit")
    with rf.Pipeline(lambda x, y: None, device=dev, chunk_bytes=1024, profile=True) as pipe:
        list(pipe.map([np.zeros(8, np.float32)] * 2))
    report = pipe.report()
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            text = str(report)
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]
    assert "efficiency" in text and "consume" in text


# -- plot -------------------------------------------------------------------------------------

def test_plot_leaves_the_backend_and_pyplot_alone_and_returns_the_figure(rep, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # any backend but Agg: plot must not switch it
        figs = plt.get_fignums()
        fig = rep.plot()
        assert isinstance(fig, Figure)
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == figs  # nothing registered with pyplot
        assert len(fig.axes) == 1 and len(fig.axes[0].patches) >= 5 * rep.chunks
        path = tmp_path / "t.png"
        fig2 = rep.plot(str(path))
        assert isinstance(fig2, Figure) and matplotlib.get_backend() == "svg"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert plt.get_fignums() == figs
    finally:
        matplotlib.use(before)


def test_plot_draws_into_the_given_axes(rep, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure()
    ax, other = fig.subplots(1, 2)
    got = rep.plot(ax=ax)
    assert got is fig
    assert len(ax.patches) >= 5 * rep.chunks and len(other.patches) == 0
    assert ax.get_xlabel().startswith("ms")
    path = tmp_path / "ax.svg"
    assert rep.plot(str(path), ax=other) is fig and path.read_text().lstrip().startswith("<?xml")
    assert len(other.patches) >= 5 * rep.chunks


@pytest.mark.parametrize("name", ["chart.txt", "chart.PNGX", "chart.png.bak"])
def test_plot_refuses_a_file_type_matplotlib_cannot_write_before_drawing(rep, tmp_path, name):
    """matplotlib said so only once the chart was drawn, in its own words; the error names the
    path, its extension and the types it can write, and nothing is drawn or written."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    path = tmp_path / name
    ext = name.rpartition(".")[2].lower()
    with pytest.raises(ValueError) as info:
        rep.plot(str(path), ax=ax)
    message = str(info.value)
    assert message.startswith("plot: ") and repr(str(path)) in message and f"cannot write .{ext} files" in message
    assert all(f".{e}" in message for e in ("png", "svg", "pdf")), message
    assert len(ax.patches) == 0 and not path.exists()
    with open(tmp_path / "open.txt", "wb") as fh:  # an open file's type is its name's too
        with pytest.raises(ValueError, match=r"cannot write \.txt files"):
            rep.plot(fh, ax=ax)
    assert len(ax.patches) == 0 and (tmp_path / "open.txt").read_bytes() == b""


def test_plot_refuses_an_axes_that_is_not_one(rep):
    pytest.importorskip("matplotlib")
    with pytest.raises(TypeError, match="matplotlib Axes"):
        rep.plot(ax="left")


def _strict_json(text):
    """JSON as a strict reader takes it: NaN and Infinity are not JSON."""
    import json

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("failing", [False, True], ids=["no items", "every item failed"])
def test_as_dict_of_a_run_without_results_is_json_with_none_for_missing_figures(failing):
    """With nothing delivered there is no efficiency and no latency: as_dict says None, and
    json.dumps(..., allow_nan=False) takes it (NaN is not JSON)."""
    import json

    dev = rf.device("sim", profile="unit")

    def f(x, y):
        y[:] = x

    def refuse(item):
        raise RuntimeError("this item is refused")

    with rf.Pipeline(f, device=dev, chunk_bytes=MB, workers=2, profile=True, on_error="continue",
                     prepare=refuse if failing else None) as pipe:
        assert list(pipe.map([np.ones(10, np.float32)] * 3 if failing else [])) == []
    rep = pipe.report()
    d = _strict_json(json.dumps(rep.as_dict(), allow_nan=False))
    assert d["chunks"] == 0 and d["efficiency"] is None
    assert d["latency_s"] == {"p50": None, "p95": None, "p99": None}
    assert d["measured_s"] == 0.0 and d["throughput_GBps"] == 0.0  # zeros that are true stay zeros
    assert "efficiency nan" in repr(rep)  # the object keeps its float for formatting


@pytest.mark.parametrize("fail", [{1, 2, 3}, {2}], ids=["every item", "one item"])
def test_a_chunk_of_small_items_counts_as_delivered_only_where_one_of_them_was(fail):
    """Small submitted items share a chunk, and a compute that raises fails its item alone while
    the chunk goes on. A chunk all of whose items failed delivered nothing: the report said
    "1 chunks" (with its bytes and throughput) where the pipeline's stats said 0 delivered."""
    dev = rf.device("sim", profile="unit")

    def f(x, y):
        if x[0] in fail:
            raise RuntimeError("this item is refused")
        y[:] = x

    with rf.Pipeline(f, device=dev, profile=True, on_error="continue") as pipe:
        futures = [pipe.submit(np.full(10, i, np.float32)) for i in (1, 2, 3)]
        outcomes = [type(fut.exception(timeout=60)).__name__ for fut in futures]
        rep, stats = pipe.report(), pipe.stats()
    assert outcomes.count("StageError") == len(fail) and stats.failed == len(fail)
    assert len(rep.timeline.records) == 1  # the three items shared one chunk
    assert rep.chunks == (1 if stats.delivered else 0)
    assert (rep.bytes_in > 0) == (stats.delivered > 0) and (rep.throughput_GBps > 0) == (stats.delivered > 0)


def test_as_dict_of_a_run_is_unchanged_where_figures_exist(rep):
    import json

    d = rep.as_dict()
    assert d["efficiency"] == rep.efficiency and d["latency_s"] == rep.latency_s
    assert json.loads(json.dumps(d, allow_nan=False))["chunks"] == 6


def test_plot_refuses_a_pgf_file_without_latex_before_drawing(rep, tmp_path, monkeypatch):
    """matplotlib writes .pgf through LaTeX, found missing only once the chart was drawn."""
    pytest.importorskip("matplotlib")
    import shutil

    from matplotlib import rcParams
    from matplotlib.figure import Figure

    tex = rcParams["pgf.texsystem"]
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # no LaTeX, whatever this machine has
    ax = Figure().add_subplot()
    path = tmp_path / "chart.pgf"
    with pytest.raises(ValueError, match=rf"^plot: \.pgf files need {tex} \(LaTeX\), which is not installed"):
        rep.plot(str(path), ax=ax)
    assert len(ax.patches) == 0 and not path.exists()
