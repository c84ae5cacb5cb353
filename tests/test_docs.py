"""The documentation agrees with the code and with the measured results it quotes."""

from __future__ import annotations

import json
import pathlib
import re
import statistics

import pytest

import ringflow
from ringflow._cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"


def test_the_reference_documents_every_public_name():
    documented = set(re.findall(r"^::: ringflow\.(\w+)$", (DOCS / "reference.md").read_text(), re.MULTILINE))
    assert documented == set(ringflow.__all__)


def test_every_page_is_in_the_navigation():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert nav == pages


def test_the_cli_page_covers_every_subcommand():
    text = (DOCS / "cli.md").read_text()
    sub = next(a for a in build_parser()._subparsers._group_actions if a.choices)
    for name in sub.choices:
        assert f"## `ringflow {name}`" in text and f"<!-- ringflow-help: {name} -->" in text, name


def _rounds(file: str, workload: str) -> tuple[float, float]:
    """stream_map's and the C++ program's best times over interleaved rounds, medians (ms): the
    rounds of a ``cpp_rounds.py`` file, or those of this tree's source in a ``stream_map_ab.sh`` one."""
    res = json.loads((RESULTS / file).read_text())
    runs = [run["rounds"] for run in res["stream_map_ab"]["runs"]["this"]] if "stream_map_ab" in res else [res]
    rounds = [r for run in runs for w in run["workloads"] if w["workload"] == workload for r in w["rounds"]]
    return (statistics.median(r["ringflow"]["stream_map"]["best_ms"] for r in rounds),
            statistics.median(r["cpp"]["best_ms"] for r in rounds))


def _pageable(file: str, ringflow_row: str, reference: str) -> tuple[float, float]:
    w = json.loads((RESULTS / file).read_text())["workloads"]["pageable"]
    rows = {r["name"]: r for r in w["rows"]}
    refs = {"link": w["floors"]["link_floor_ms"], "floor": w["floor_ms"]}
    ref = refs[reference] if reference in refs else rows[reference]["ms_median"]
    return rows[ringflow_row]["ms_median"], ref


ROUNDS = "call-start-ab-h200-2026-12-07-at-ecdb835.json"
FULL = "bench-h200-2026-11-30-s4-stream-map-direct.json"
STAGED = "ringflow stream_map host=auto"
# (the start of the table row, ringflow ms, reference ms, digits)
HEADLINE = [
    ("| `seed`: 256 MiB pinned, in place, the tutorial's kernel |", *_rounds(ROUNDS, "seed"), 2),
    ("| `balanced`: the kernel takes one copy's time |", *_rounds(ROUNDS, "balanced"), 2),
    ("| `compute-bound`: the kernel takes three copies' time |", *_rounds(ROUNDS, "compute-bound"), 2),
    ("| 1 GiB in, 1 GiB out, arrays pinned once",
     *_pageable(FULL, "ringflow MapJob host=register, repeated calls (x, out pinned once)", "link"), 1),
    ("| 1 GiB ordinary numpy array in, a new one out (`stream_map`) |", *_pageable(FULL, STAGED, "floor"), 1),
    ("| the same | 81.1 ms | hand-written PyTorch", *_pageable(FULL, STAGED, "hand-written torch 3-stream pipeline"), 1),
    ("| the same | 81.1 ms | naive PyTorch", *_pageable(FULL, STAGED, "torch naive .cuda()/.cpu()"), 1),
]


@pytest.mark.parametrize("page", ["README.md", "docs/performance.md"])
@pytest.mark.parametrize("start, ours, ref, digits", HEADLINE, ids=[h[0] for h in HEADLINE])
def test_headline_figures_are_the_measured_ones(page, start, ours, ref, digits):
    lines = [line for line in (ROOT / page).read_text().splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"{page}: {len(lines)} rows start with {start!r}"
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[1] == f"{ours:.{digits}f} ms"
    assert cells[2].endswith(f", {ref:.{digits}f} ms")
    assert cells[3] == f"{ours / ref:.2f}"


def test_the_table_of_every_run_against_the_cpp_program_is_the_results():
    from ringflow._bench.rounds import rounds_table

    text = (DOCS / "performance.md").read_text()
    after = text.split("## Every run against the C++ program", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    end = next(i for i in range(start, len(after)) if not after[i].startswith("|"))
    assert "\n".join(after[start:end]) == rounds_table(RESULTS)


def _feed(file: str) -> tuple[float, float]:
    """ringflow's ms a batch with worker processes, and the DataLoader's."""
    rows = json.loads((RESULTS / file).read_text())["workloads"]["feed"]["rows"]
    ours = next(r for r in rows if "processes=True" in r["name"])
    theirs = next(r for r in rows if r["name"].startswith("torch DataLoader"))
    return ours["ms_median"], theirs["ms_median"]


def _inference(file: str) -> tuple[float, float]:
    """A registered MapJob's median call over the numpy array of images, and the link's floor (ms)."""
    res = json.loads((RESULTS / file).read_text())
    return sorted(res["one numpy array"]["mapjob_s"])[1] * 1e3, res["link_floor"]["link_floor_ms"]


def _graph_vs_cpp(file: str, workload: str) -> tuple[float, float]:
    """The best graph call and the C++ program's best on the host clock (ms), one run."""
    entry = json.loads((RESULTS / file).read_text())["workloads"][workload]
    return entry["best_ms"]["graph"], entry["cuda_cpp"]["host_clock"]["ms_median"]


def _graph_small(file: str, workload: str, chunk_bytes: int) -> tuple[float, float]:
    """The graph call at ``chunk_bytes`` and at the best chunk size (ms), one run."""
    entry = json.loads((RESULTS / file).read_text())["workloads"][workload]
    row = next(r for r in entry["rows"] if r["chunk_bytes"] == chunk_bytes)
    return row["graph"]["ms_median"], entry["best_ms"]["graph"]


def _requests(file: str) -> tuple[float, float]:
    """ms a request at capacity: ringflow's and the hand-written torch ring's, one run."""
    r = json.loads((RESULTS / file).read_text())["workloads"]["requests"]
    ring = next(s for s in r["side_by_side"] if "torch pinned ring" in s["name"])
    return 1e3 / r["capacity_per_s"], 1e3 / ring["capacity_per_s"]


def _mapjob_vs_cpp(file: str, workload: str) -> tuple[float, float]:
    """MapJob's best untouched call and the C++ program's best on the host clock (ms), one run."""
    w = json.loads((RESULTS / file).read_text())["workloads"][workload]
    ours = min(r["ms_median_no_refill"] for r in w["rows"]
               if r["name"].startswith("ringflow MapJob") and r.get("engine") == "direct")
    return ours, w["versus_cpp"]["untouched_input"]["cpp_best_ms_host_clock"]


def _one_side_staged(file: str) -> tuple[float, float]:
    """1 GiB of ordinary memory in: with a pool array as out, and with a new ordinary out (ms)."""
    cases = json.loads((RESULTS / file).read_text())["pool_calls"]["cases"]
    return cases["pageable in, out= a pool array"]["ms_median"], cases["pageable in, new ordinary out"]["ms_median"]


LATER = [
    ("| `requests`: a stream of fresh numpy requests", *_requests("bench-h200-2026-12-06-at-3b6d4cc.json"),
     " a request"),
    ("| `compute-bound`, `MapJob`", *_mapjob_vs_cpp("bench-h200-2026-12-02-plan-repeat-d.json", "compute-bound"), ""),
    ("| `balanced`, `MapJob(graph=True)`", *_graph_vs_cpp("graph-h200-2026-12-01-final-one-stream.json", "balanced"), ""),
    ("| `seed` in 256 KiB chunks", *_graph_small("graph-h200-2026-12-01-final-planned.json", "seed", 256 << 10), ""),
    ("| `feed`: 64 images decoded on 8 CPU workers", *_feed("feed-h200-2026-12-01-final-a.json"), " a batch"),
    ("| 3072 uint8 images (462 MB) in, a float16 row each out",
     *_inference("inference-h200-2026-12-01-whole-registered.json"), ""),
    ("| 1 GiB ordinary numpy array in, a pinned `out=", *_one_side_staged("pool-link-h200-2026-12-01.json"), ""),
]


@pytest.mark.parametrize("start, ours, ref, unit", LATER, ids=[h[0] for h in LATER])
def test_the_later_readme_rows_are_the_measured_ones(start, ours, ref, unit):
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(start)]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[1] == f"{ours:.2f} ms{unit}"
    assert cells[2].endswith(f", {ref:.2f} ms")
    assert cells[3] == f"{ours / ref:.2f}"


def test_every_results_file_is_listed():
    listing = (RESULTS / "README.md").read_text()
    for path in RESULTS.iterdir():
        if path.name == "README.md":
            continue
        # rows name a run's sibling files by their tail: `name-run1.json`, `-run2.json`
        tail = re.search(r"-(run\d+\.json)$", path.name)
        assert path.name in listing or (tail and f"`-{tail.group(1)}`" in listing), path.name


def test_the_code_speaks_of_the_project_only():
    """Sources, tests and bench scripts cite nothing outside the repository and name no sitting."""
    for path in sorted([*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
                        *ROOT.glob("bench/*.sh")]):
        if path.name == "test_docs.py":
            continue
        text = path.read_text()
        assert not re.search(r"\b(session|sessions|lease|leases)\b|issue #", text, re.IGNORECASE), path
        assert "DESIGN.md" not in text and "../shared" not in text, path


@pytest.mark.parametrize("page", ["README.md", "bench/results/README.md",
                                  *(str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md"))),
                                  *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "examples").glob("*.py")))])
def test_pages_speak_of_the_project_only(page):
    text = (ROOT / page).read_text()
    assert not re.search(r"\b(session|sessions|lease|leases)\b|issue #", text, re.IGNORECASE)
    assert "DESIGN.md" not in text and "../shared" not in text


def test_every_public_name_and_its_public_methods_have_a_docstring():
    """The API reference renders these: a class, function or public method without one shows a
    bare signature."""
    import inspect

    import ringflow as rf

    missing = []
    for name in rf.__all__:
        obj = getattr(rf, name)
        if isinstance(obj, str):
            continue
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        # a dataclass without a docstring gets its signature as one, which says nothing
        if not (own or "").strip() or (inspect.isclass(obj) and own.startswith(f"{obj.__name__}(")):
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr in dir(obj):
                # the member as the class resolves it, where ringflow defines it (properties too)
                klass = next((k for k in obj.__mro__ if attr in vars(k)), None)  # None: an enum's member
                if attr.startswith("_") or klass is None or klass.__module__.split(".")[0] != "ringflow":
                    continue
                value = vars(klass)[attr]
                if (callable(value) or isinstance(value, property)) and not (value.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, missing


def test_public_constructors_show_their_parameters():
    """``inspect.signature`` (help(), notebooks, IDEs) gives the real parameters, not a
    dispatching ``__new__``'s ``*args, **kwargs``."""
    import inspect

    import ringflow as rf

    for cls in (rf.Pipeline, rf.MapJob, rf.Kernel, rf.RayMapper):
        params = inspect.signature(cls).parameters
        assert not any(p.kind in (p.VAR_POSITIONAL,) for p in params.values()), (cls, params)
        assert "self" not in params
    assert list(inspect.signature(rf.Pipeline).parameters)[:3] == ["compute", "device", "prepare"]


def test_the_numpy_floor_in_pyproject_has_every_numpy_module_the_package_imports():
    """``numpy.lib.array_utils`` (imported by the simulated GPU and the pipeline) is NumPy 2's:
    with a lower floor, pip would keep a NumPy 1 and ``import ringflow`` would fail."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    (numpy,) = [d for d in deps if re.match(r"numpy\b", d)]
    floor = re.search(r">=\s*(\d+)", numpy)
    sources = (ROOT / "src" / "ringflow").rglob("*.py")
    if any("numpy.lib.array_utils" in p.read_text() for p in sources):
        assert floor is not None and int(floor.group(1)) >= 2, numpy


def _python_blocks(page: str) -> list[str]:
    """The ```python blocks of a page, in order, dedented to their fence."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", (ROOT / page).read_text(), re.MULTILINE | re.DOTALL)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in blocks]


def _block(page: str, start: str) -> str:
    (block,) = [b for b in _python_blocks(page) if b.startswith(start)]
    return block


def _run_block(code: str, **names) -> dict:
    """Runs a page's snippet on a simulated GPU, with ``names`` defined first (what the text
    around it gives), and returns its namespace."""
    import numpy as np

    namespace = {"np": np, "rf": ringflow, **names}
    exec(compile(code, "<snippet>", "exec"), namespace)
    return namespace


def test_the_pipeline_guides_output_snippet_takes_the_batch_it_describes():
    """``scores`` is written for a (64, 3, 224, 224) uint8 batch: both pipelines the snippet
    makes take one and give its (64, 3) float16 scores."""
    import types

    import numpy as np

    made = []
    dev = ringflow.device("sim")
    rf = types.SimpleNamespace(Pipeline=lambda *a, **kw: made.append(ringflow.Pipeline(*a, device=dev, **kw)))
    _run_block(_block("docs/guide/pipeline.md", "def scores(x, y):"), rf=rf)
    assert len(made) == 2
    batch = np.random.default_rng(0).integers(0, 256, (64, 3, 224, 224), dtype=np.uint8)
    for pipe in made:
        with pipe:
            (result,) = pipe.map([batch])
        assert result.shape == (64, 3) and result.dtype == np.float16
        np.testing.assert_allclose(result, batch.reshape(64, 3, -1).mean(axis=2), rtol=1e-3)


def test_the_pipeline_guides_spec_per_item_takes_batches_of_any_length():
    """The second pipeline of the snippet makes its output spec from each item (``len(b)``
    rows), which is for batches of different lengths; ``scores`` reshaped every batch to 64
    rows, so any other length failed in compute."""
    import types

    import numpy as np

    made = []
    dev = ringflow.device("sim")
    rf = types.SimpleNamespace(Pipeline=lambda *a, **kw: made.append(ringflow.Pipeline(*a, device=dev, **kw)))
    _run_block(_block("docs/guide/pipeline.md", "def scores(x, y):"), rf=rf)
    made[0].close()
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 256, (n, 3, 224, 224), dtype=np.uint8) for n in (40, 64, 1)]
    with made[1] as pipe:
        results = list(pipe.map(batches))
    for batch, result in zip(batches, results):
        assert result.shape == (len(batch), 3) and result.dtype == np.float16
        np.testing.assert_allclose(result, batch.reshape(len(batch), 3, -1).mean(axis=2), rtol=1e-3)


# (page, the start of its block, the callable the block's first call spells out)
SIGNATURES = [
    ("docs/guide/stream-map.md", "y = rf.stream_map(", "stream_map"),
    ("docs/guide/mapjob.md", "with rf.MapJob(", "MapJob"),
    ("docs/guide/pipeline.md", "with rf.Pipeline(", "Pipeline"),
    ("docs/guide/kernel.md", "k = rf.Kernel(", "Kernel"),
    ("docs/guide/pinned-memory.md", "x = rf.host.empty(", "host.empty"),
]


@pytest.mark.parametrize("page, start, name", SIGNATURES, ids=[s[2] for s in SIGNATURES])
def test_the_signature_a_guide_opens_with_is_the_codes(page, start, name):
    """The parameters, their kinds and defaults, as the guide's first block writes them."""
    import ast
    import inspect

    import numpy as np

    code = _python_blocks(page)[0]
    assert code.startswith(start)
    args = code[code.index("(") + 1:]
    depth, end = 1, 0
    while depth:
        depth += {"(": 1, ")": -1}.get(args[end], 0)
        end += 1
    written = ast.parse(f"def _({args[:end - 1]}): pass").body[0].args
    obj = ringflow
    for part in name.split("."):
        obj = getattr(obj, part)
    real = inspect.signature(obj).parameters

    def described(arg, default, kind):
        value = inspect.Parameter.empty if default is None else eval(ast.unparse(default), {"np": np})
        return arg.arg, kind, value

    positional = written.posonlyargs + written.args
    defaults = [None] * (len(positional) - len(written.defaults)) + written.defaults
    params = [described(a, d, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a, d in zip(positional, defaults)]
    params += [described(a, d, inspect.Parameter.KEYWORD_ONLY) for a, d in zip(written.kwonlyargs, written.kw_defaults)]
    assert written.vararg is None and written.kwarg is None, f"{page}: the code takes no catch-all"
    assert params == [(p.name, p.kind, p.default) for p in real.values()]


@pytest.mark.filterwarnings("ignore::ringflow._device.SimulatedFallbackWarning")  # ("auto" without a GPU, as it says)
@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_quick_start_runs_as_written(page):
    """The first snippet a new user copies runs as it stands (``"auto"`` is the simulated GPU
    here), and what it computes is what its comments say."""
    import numpy as np

    (code,) = [b for b in _python_blocks(page) if "import ringflow as rf" in b and "stream_map" in b]
    namespace = _run_block(code)
    x, y = namespace["x"], namespace["y"]
    np.testing.assert_array_equal(y, x * 2 + 1)
    np.testing.assert_array_equal(namespace["result"], namespace["requests"][-1] * 2 + 1)  # the map's last
    if "fut" in namespace:
        np.testing.assert_array_equal(namespace["fut"].result(), namespace["requests"][0] * 2 + 1)
    namespace["dev"].close()
