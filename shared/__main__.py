"""``python -m rlfleet.shared ARGS``: the rlfleet CLI as a child of ``rlfleet up`` (bots, serve): it stops
when its parent is gone."""

from rlfleet.shared.cli import main
from rlfleet.worker.runner import stop_with_parent

if __name__ == "__main__":
    stop_with_parent()
    main()
