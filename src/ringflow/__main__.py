"""``python -m ringflow``: the command line, as the ``ringflow`` script."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
