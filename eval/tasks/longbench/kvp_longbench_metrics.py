"""LongBench scoring for the kvp_longbench_* tasks: lm-eval's own functions, imported on first use.

lm-eval's ``longbench/metrics.py`` needs ``jieba``, ``fuzzywuzzy`` and ``rouge``
(``pip install "lm_eval[longbench]"``) at import; importing it only when a result is scored
keeps the task configs loadable (and testable) without them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def _from_lm_eval(name: str) -> Callable[..., dict]:
    def process_results(doc: dict, results: list[str], **kwargs) -> dict:
        metrics = importlib.import_module("lm_eval.tasks.longbench.metrics")
        return getattr(metrics, name)(doc, results, **kwargs)

    process_results.__name__ = name
    return process_results


get_qa_f1_with_score = _from_lm_eval("get_qa_f1_with_score")
get_qa_f1_zh_with_score = _from_lm_eval("get_qa_f1_zh_with_score")
get_rouge_with_score = _from_lm_eval("get_rouge_with_score")
get_rouge_zh_with_score = _from_lm_eval("get_rouge_zh_with_score")
get_classification_with_score = _from_lm_eval("get_classification_with_score")
get_count_with_score = _from_lm_eval("get_count_with_score")
get_retrieval_with_score = _from_lm_eval("get_retrieval_with_score")
get_retrieval_zh_with_score = _from_lm_eval("get_retrieval_zh_with_score")
get_code_sim_with_score = _from_lm_eval("get_code_sim_with_score")
