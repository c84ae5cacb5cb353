"""Why the ``feed`` workload's ringflow rows stop where they do: the same workload with the
pipeline's workers, slots and the making of each batch varied, against the DataLoader, in one run.

Rows: worker processes and worker threads, each with batches made in their pinned slots
(``rf.host.empty_slot``, the default) and in new arrays copied in; with ``--slots``, also the
host-in ring at a slot per worker and one more (the earlier default) and ``ordered=False``. The
bound and the DataLoader are measured as ``ringflow bench feed`` measures them.

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
    ap.add_argument("--slots", action="store_true", help="also the slot and ordering rows")
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
        fresh = feed.ImageBatches(args.batch, args.size, in_slot=False)
        variants = [("processes, in slot", images, not sim, {}), ("processes, new array", fresh, not sim, {}),
                    ("threads, in slot", images, False, {}), ("threads, new array", fresh, False, {})]
        if args.slots:
            planned = rf.Pipeline(feed.normalise, device=dev, prepare=images.decode_augment,
                                  chunk_bytes=images.nbytes * 2, workers=workers,
                                  output=(images.shape, "float16"), deliver="device")
            slots = planned.config.slots
            planned.close()
            fewer = rf.SlotCounts(workers + 1, slots.device_in, slots.device_out, slots.host_out)
            variants += [("processes, a slot per worker and one", images, not sim, {"slots": fewer}),
                         ("processes, ordered=False", images, not sim, {"ordered": False})]
        rows = []
        for name, made, processes, options in variants:
            print("feed:", name, flush=True)
            rows.append(feed.ringflow_feed(dev, made, side, workers=workers, batches=args.batches,
                                           rounds=args.rounds, check=8, processes=processes, name=name,
                                           prepare=made.decode_augment, **options))
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
