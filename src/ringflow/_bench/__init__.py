"""Named workloads, baselines and the runner behind `ringflow bench` and `ringflow demo`."""
