"""A Ray Data dataset through a GPU function, one warm ringflow engine per actor: rf.RayMapper.

    pip install 'ringflow[ray]'
    python examples/06_ray_data.py

Each Ray actor makes its device once and streams every batch's "x" column through ``f`` with
``stream_map`` into a new "y" column. With GPUs in the cluster each actor takes one
(``num_gpus=1``) and uses it as its CUDA device; without any, two CPU-only actors use the
simulated GPU (its clock is virtual). Then a compute that refuses one value shows how a failed
chunk is reported: the stage and the rows of the batch it held.
"""

import sys

import numpy as np

import ringflow as rf

try:
    import ray
    import ray.data
except ImportError:
    print("this example needs Ray Data: pip install 'ringflow[ray]' (skipped)")
    sys.exit(0)


def f(x, y):  # numpy on the simulated GPU, CuPy on a real one: the same expression
    y[...] = x * 2 + 1


def refuses_12345(x, y):
    if (x == 12345).any():
        raise ValueError("12345 is not allowed")
    y[...] = x * 2 + 1


def main():
    ray.init(include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:  # one actor per GPU; each actor's device is its own GPU
        where, device, resources = f"{gpus} GPU actor(s)", None, dict(num_gpus=1, size=gpus)
    else:  # CPU-only actors on the simulated GPU (a quarter CPU each leaves CPUs for the reads)
        where, device, resources = "2 CPU actors (simulated GPU)", "sim", dict(num_gpus=0, num_cpus=0.25, size=2)
    size = resources.pop("size")

    n = 200_000

    def through(fn):  # rows id = 0..n-1 and x = id as float32, then f over x into y
        ds = ray.data.range(n, override_num_blocks=8).map_batches(
            lambda b: {"id": b["id"], "x": b["id"].astype(np.float32)}, batch_format="numpy")
        return ds.map_batches(
            rf.RayMapper,
            fn_constructor_kwargs={"f": fn, "columns": ["x"], "output_columns": ["y"], "id_column": "id",
                                   "device": device, "chunk_bytes": 16 << 10},
            batch_format="numpy", batch_size=25_000, compute=ray.data.ActorPoolStrategy(size=size), **resources)

    table = through(f).to_pandas().sort_values("id")
    assert list(table["id"]) == list(range(n))
    np.testing.assert_array_equal(table["y"].to_numpy(), table["x"].to_numpy() * 2 + 1)
    print(f"ray data: {n} rows through f on {where}, result matches numpy")

    # Ray wraps a failed batch's exception; ask for the original (a dataset takes the context it
    # was made in) to catch it as rf.StageError.
    ctx.raise_original_map_exception = True
    try:
        through(refuses_12345).materialize()
    except rf.StageError as e:
        start, stop = e.rows
        print(f"error: stage {e.stage!r} failed for rows {start}..{stop - 1} of a batch of {e.batch_rows} rows "
              f"(id {e.ids[0]}..{e.ids[1]}): {type(e.cause.__cause__).__name__}: {e.cause.__cause__}")
    ray.shutdown()


if __name__ == "__main__":
    main()
