"""``python -m rlfleet.cli ARGS``: the ``rlfleet`` command as a child of ``rlfleet up`` (bots, serve,
bridge): it stops when its parent is gone."""

from rlfleet.shared.lifecycle import stop_with_parent

from . import main

if __name__ == "__main__":
    stop_with_parent()
    main()
