"""Training tooling for KVP policies, run from a checkout as ``python -m train <command>``.

collect -> traces on disk (train/collect.py); fit -> a KVPolicy (train/rl.py, train/supervised.py);
evaluate -> eviction-cost curves of the policy and every baseline (train/evaluate.py); push -> Hub.
"""
