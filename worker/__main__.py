"""``python -m rlfleet.worker --queue events|train|all``: what ``rlfleet worker`` and ``chat`` run."""

from rlfleet.shared.cli import main

if __name__ == "__main__":
    import sys

    sys.argv = ["rlfleet", "worker", *sys.argv[1:]]
    main()
