#!/bin/bash
# Wheels of rlfleet's runtime dependencies that a bare CUDA image (torch, transformers and peft
# already installed) lacks, for a machine with no route to an index: fetched here, carried there,
# installed by bench/offline/run.sh. Usage: bench/offline/wheels.sh [PYTHON_VERSION] (default 3.12)
set -eu
py=${1:-3.12}
out=$(dirname "$0")/wheels
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" pydantic pydantic_core 'typing_extensions>=4.16' annotated_types typing_inspection \
  sqlalchemy alembic mako 'redis>=5,<8.2' rq croniter tomli_w gguf dill  # redis: pyproject's pin
# pydantic pins one pydantic-core: a mismatched pair fails at import, so check here, not there
want=$(unzip -p "$out"/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
ls "$out" | grep -q "pydantic_core-$want-" || { echo "pydantic wants pydantic-core $want: not fetched" >&2; exit 1; }
du -sh "$out"
