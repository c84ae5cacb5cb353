"""Why the ``feed`` workload's ringflow rows stop short of the CPU stage's bound: the same
workload with the pipeline's slots and ordering varied, against the DataLoader, in one run.

Rows (all ``processes=True``, the CPU stage in worker processes): the planned slots; more
host-in slots (two per worker, so a worker never waits for a slot while others' batches wait
their turn); ``ordered=False`` (a late batch holds back none after it); and both. The bound and
the DataLoader are measured as ``ringflow bench feed`` measures them.

    PYTHONPATH=src python3 bench/feed_variants.py --device cuda:0 --out feed-variants.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import feed  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64, help="images per batch")
    ap.add_argument("--size", type=int, default=224, help="image height and width (small for a dry run on the sim)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    workers = args.workers or feed.default_workers()
    images = feed.ImageBatches(args.batch, args.size)
    side = feed.model_side(dev, images, 256)
    res = {**header(str(dev)), "environment": environment(dev), "workers": workers, "batches": args.batches}
    sim = dev.backend == "sim"
    try:
        cpu = {"threads": feed.cpu_stage_seconds(dev, images.decode_augment, workers, 4 * workers)}
        if not sim:
            cpu["processes"] = feed.cpu_stage_seconds_processes(images, workers, 8 * workers)
        bound = feed.stage_bound({"cpu_decode_augment": min(cpu.values()),
                                  "h2d_copy": feed.h2d_stage_seconds(dev, images.nbytes, 8),
                                  "gpu_normalise_model": side.gpu_stage_seconds(8)})
        res["bound"] = bound
        res["cpu_stage_ms"] = {k: v * 1e3 for k, v in cpu.items()}
        planned = rf.Pipeline(feed.normalise, device=dev, prepare=images.decode_augment,
                              chunk_bytes=images.nbytes * 2, workers=workers,
                              output=(images.shape, "float16"), deliver="device")
        slots = planned.config.slots
        planned.close()
        more = rf.SlotCounts(2 * workers, slots.device_in, slots.device_out, slots.host_out)
        variants = [("planned slots", {}), ("host-in 2 per worker", {"slots": more}),
                    ("ordered=False", {"ordered": False}),
                    ("host-in 2 per worker, ordered=False", {"slots": more, "ordered": False})]
        rows = []
        for name, options in variants:
            print("feed:", name, flush=True)
            rows.append(feed.ringflow_feed(dev, images, side, workers=workers, batches=args.batches,
                                           rounds=args.rounds, check=8, processes=not sim, name=name, **options))
        if not sim:
            print("feed: DataLoader", flush=True)
            rows.append(feed.dataloader_feed(images, side, workers=workers, batches=args.batches,
                                             rounds=args.rounds, check=8))
        dl = rows[-1]["batches_per_s"] if not sim else None
        for row in rows:
            row["fraction_of_bound"] = feed.fraction_of_bound(row, bound)
            row["vs_dataloader"] = row["batches_per_s"] / dl if dl else None
            print(f"{row['name']:45s} {row['batches_per_s']:8.1f}/s  of bound {row['fraction_of_bound']:.3f}  "
                  f"vs DataLoader {row['vs_dataloader']}  correct {row['correct']}")
        res["rows"] = rows
    finally:
        side.close()
    write(res, args.out)


if __name__ == "__main__":
    main()
