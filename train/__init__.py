"""Training tooling for KVP policies, run from a checkout as ``python -m train <command>``.

- collect -> traces on disk (``collect.py``; prompts from ``data.py`` and ``corpora.py``; targets
  from ``targets.py``; the on-disk format in ``traces.py``);
- fit -> a KVPolicy (``fit.py``; objectives in ``rl.py`` and ``supervised.py``; the cost in ``reward.py``);
- evaluate -> eviction-cost curves of the policy and every baseline (``evaluate.py``, ``plots.py``);
- push -> Hub (``push.py``); reproduce -> the shipped SmolLM2 policy from nothing (``reproduce.py``).
"""
