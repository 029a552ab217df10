"""HellaSwag document preprocessing, as lm-eval's ``hellaswag/utils.py`` does it."""

from __future__ import annotations

import re

import datasets


def preprocess(text: str) -> str:
    text = text.strip()
    # Brackets are artifacts of the WikiHow part of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    def process(doc: dict) -> dict:
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": preprocess(doc["activity_label"] + ": " + context),
            "choices": [preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(process)
