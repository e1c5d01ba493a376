#!/bin/bash
# Run a bench module from this checkout on a machine that has torch, transformers and peft but not
# the rest of rlfleet's dependencies and no index to fetch them from (a lent GPU box): installs the
# wheels of bench/offline/wheels.sh into /tmp/rlfleet-site, maps the `rlfleet` package onto this
# checkout (as the editable install's package-dir does) and runs `python -m ARGS`.
#   bench/offline/run.sh bench.train_gpu --unlikelihood 0     (PYTHON=... picks the interpreter)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
site=/tmp/rlfleet-site
if [ ! -f "$site/.installed" ]; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --target "$site" "$root"/bench/offline/wheels/*.whl
  touch "$site/.installed"
fi
mkdir -p "$site/shim/rlfleet"
cat > "$site/shim/rlfleet/__init__.py" <<PY
import os
__path__ = [os.environ["RLFLEET_ROOT"], os.path.join(os.environ["RLFLEET_ROOT"], "worker")]
PY
export RLFLEET_ROOT=$root PYTHONPATH=$site/shim:$site:$root${PYTHONPATH:+:$PYTHONPATH}
cd "$root"
exec "${PYTHON:-python3}" -m "$@"
