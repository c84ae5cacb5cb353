"""``python -m ringflow``: the command line, as the ``ringflow`` script (:mod:`_ringflow_entry`)."""

if __name__ == "__main__":
    from _ringflow_entry import main

    raise SystemExit(main())
