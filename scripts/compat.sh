#!/usr/bin/env bash
# Run the core cache tests on the oldest and the pre-5.4 transformers this package supports
# (4.57 passes cache_position to the cache, 5.3 is the last release before the 5.4 API change).
set -euo pipefail
cd "$(dirname "$0")/.."
for version in 4.57.6 5.3.0; do
  venv=".venv-compat/transformers-$version"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0" "transformers==$version" accelerate safetensors tqdm pytest
  "$venv/bin/pip" install -q --no-deps -e .
  echo "== transformers $version"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_cache.py tests/test_errors.py
done
