"""``python -m rlfleet.worker --queue events|train|all``: what ``rlfleet worker`` and ``chat`` run."""

from rlfleet.shared.cli import main
from rlfleet.worker.runner import stop_with_parent

if __name__ == "__main__":
    import sys

    stop_with_parent()
    sys.argv = ["rlfleet", "worker", *sys.argv[1:]]
    main()
