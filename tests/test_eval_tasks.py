"""The lm-eval task configs in eval/tasks, offline: Hub datasets are replaced by local fixtures of the
same schema, RULER data comes from kvp_cache.ruler."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytest.importorskip("lm_eval")

import datasets  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from test_lm_eval import assert_same_scores, tiny_dir  # noqa: E402, F401  (tiny_dir is a fixture)

from kvp_cache import ruler  # noqa: E402
from kvp_cache.integrations.lm_eval import KVPLM, SPLIT_MARKER, split_at_marker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "eval" / "tasks"
RULER_TASKS = [f"kvp_ruler_{t}_{p}" for t in ruler.TASKS for p in ("qin", "qafter")]
LONGBENCH = sorted(
    re.match(r"kvp_longbench_(.+)_qin", p.stem).group(1)
    for p in (TASKS_DIR / "longbench").glob("kvp_longbench_*_qin.yaml")
)
LONGBENCH = [n for n in LONGBENCH if n != "paper"]
MC_TASKS = ["kvp_mmlu", "kvp_hellaswag", "kvp_boolq_qin", "kvp_boolq_qafter", "kvp_arc_challenge"]
LONGBENCH_TASKS = [f"kvp_longbench_{n}_{p}" for n in LONGBENCH for p in ("qin", "qafter")]
PASSAGE = "The harbor froze in the winter of 1911, and the ferries stopped for six weeks. " * 3


def hub_rows(path: str, name: str | None) -> dict[str, list[dict]]:
    """A few rows per split in the schema of each Hub dataset the task configs name."""
    if path == "cais/mmlu":
        rows = [
            {"question": f"What is {i} + 1? ", "subject": "high_school_mathematics", "choices": ["1", "2", "3", "4"],
             "answer": i % 4}
            for i in range(4)
        ]  # fmt: skip
        return {"test": rows, "dev": rows}
    if path == "Rowan/hellaswag":
        rows = [
            {"ind": i, "activity_label": "Ice fishing", "ctx_a": PASSAGE, "ctx_b": "then they", "ctx": PASSAGE,
             "endings": ["drill a hole [title] slowly.", "fly away.", "sing.", "sleep."], "source_id": "x",
             "split": "val", "split_type": "indomain", "label": str(i % 4)}
            for i in range(4)
        ]  # fmt: skip
        return {"train": rows, "validation": rows}
    if path == "aps/super_glue" and name == "boolq":
        rows = [
            {"question": f"did the harbor freeze {i}", "passage": PASSAGE, "idx": i, "label": i % 2}
            for i in range(4)
        ]
        return {"train": rows, "validation": rows}
    if path == "allenai/ai2_arc" and name == "ARC-Challenge":
        rows = [
            {"id": f"q{i}", "question": f"Which season froze the harbor {i}?",
             "choices": {"text": ["winter", "summer", "spring", "autumn"], "label": ["A", "B", "C", "D"]},
             "answerKey": "ABCD"[i % 4]}
            for i in range(4)
        ]  # fmt: skip
        return {"train": rows, "validation": rows, "test": rows}
    if path == "Xnhyacinth/LongBench":
        rows = [
            {"context": PASSAGE + f"Paragraph {i}.", "question": f"When did the harbor freeze? ({i})",
             "answers": ["1911"], "length": 40, "dataset": name, "language": "en", "all_classes": ["a", "b"],
             "_id": str(i)}
            for i in range(3)
        ]  # fmt: skip
        return {"test": rows}
    raise AssertionError(f"a task config asked for an unexpected dataset {path!r} / {name!r}")


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Serve the task configs' Hub datasets from local JSON files of the same schema."""
    real = datasets.load_dataset

    def load_dataset(path, name=None, **kwargs):
        if path in ("json", "csv", "parquet", "text"):
            return real(path, name=name, **kwargs)
        files = {}
        for split, rows in hub_rows(path, name).items():
            file = tmp_path / f"{path.replace('/', '_')}_{name}_{split}.jsonl"
            file.write_text("".join(json.dumps(row) + "\n" for row in rows))
            files[split] = str(file)
        return real("json", data_files=files)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def task_manager(**metadata) -> TaskManager:
    """Our configs only: they reference no built-in task, and indexing lm-eval's thousands takes seconds."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata or None)


@pytest.fixture(scope="module")
def manager() -> TaskManager:
    return task_manager()


def requests_of(task, limit=2):
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return task.instances


def test_every_config_is_indexed(manager):
    tasks, groups = set(manager.all_tasks), set(manager.all_groups)
    assert set(RULER_TASKS + MC_TASKS + LONGBENCH_TASKS) <= tasks
    assert len(LONGBENCH) == 21
    assert {
        "kvp_ruler_qin", "kvp_ruler_qafter", "kvp_longbench_qin", "kvp_longbench_qafter",
        "kvp_longbench_paper_qin", "kvp_longbench_paper_qafter", "kvp_paper_zeroshot",
    } <= groups  # fmt: skip


@pytest.mark.parametrize("name", MC_TASKS + LONGBENCH_TASKS)
def test_hub_task_builds_requests(offline_hub, manager, name):
    task = manager.load([name])["tasks"][name]
    instances = requests_of(task)
    assert instances
    for instance in instances:
        context = instance.args[0]
        if not name.endswith("_qafter"):
            assert SPLIT_MARKER not in context
            continue
        assert context.count(SPLIT_MARKER) == 1
        head, text = split_at_marker(context)
        doc = instance.doc
        document = doc.get("passage") or doc["context"]
        assert head.rstrip().endswith(document.rstrip())  # the document is compressed...
        assert doc["question"] not in head  # ...and the question, where the prompt has one, comes after it
        if "{{question}}" in str(task.config.doc_to_text):
            assert doc["question"] in text[len(head) :]


def test_qafter_prompts_equal_qin_prompts_without_the_marker(offline_hub, manager):
    pairs = [("kvp_boolq_qin", "kvp_boolq_qafter")] + [
        (f"kvp_longbench_{n}_qin", f"kvp_longbench_{n}_qafter") for n in LONGBENCH
    ]
    for qin, qafter in pairs:
        tasks = manager.load([qin, qafter])["tasks"]
        plain = [i.args[0] for i in requests_of(tasks[qin])]
        marked = [split_at_marker(i.args[0])[1] for i in requests_of(tasks[qafter])]
        assert plain == marked, qafter


def test_multiple_choice_tasks_run_and_full_budget_equals_hf(offline_hub, manager, tiny_dir):  # noqa: F811
    kvp = KVPLM(pretrained=tiny_dir, device="cpu", attn_implementation="eager", budget=1.0, method="snapkv")
    hf = HFLM(pretrained=tiny_dir, device="cpu", attn_implementation="eager")
    got = simple_evaluate(model=kvp, tasks=MC_TASKS, task_manager=manager, limit=3, log_samples=True)
    expected = simple_evaluate(model=hf, tasks=MC_TASKS, task_manager=manager, limit=3, log_samples=True)
    for name in MC_TASKS:
        # kvp_boolq_qafter with nothing evicted is hf on the unmarked prompt, kvp_boolq_qin.
        reference = "kvp_boolq_qin" if name == "kvp_boolq_qafter" else name
        assert got["results"][name]["acc,none"] == expected["results"][reference]["acc,none"]
        mine = [tuple(r) for s in got["samples"][name] for resp in s["resps"] for r in resp]
        theirs = [tuple(r) for s in expected["samples"][reference] for resp in s["resps"] for r in resp]
        assert_same_scores(mine, theirs)
    compressed = KVPLM(
        pretrained=tiny_dir, device="cpu", budget=4, method="knorm", sink_tokens=1, window_tokens=1
    )
    small = simple_evaluate(
        model=compressed, tasks=["kvp_boolq_qafter"], task_manager=manager, limit=3, log_samples=True
    )
    assert [s["resps"] for s in small["samples"]["kvp_boolq_qafter"]] != [
        s["resps"] for s in got["samples"]["kvp_boolq_qafter"]
    ]


def test_longbench_generation_runs_and_full_budget_equals_hf(offline_hub, manager, tiny_dir):  # noqa: F811
    names = ["kvp_longbench_passage_retrieval_en_qafter", "kvp_longbench_gov_report_qafter"]
    options = dict(
        task_manager=manager, limit=2, log_samples=True, predict_only=True, gen_kwargs={"max_gen_toks": 5}
    )
    kvp = KVPLM(pretrained=tiny_dir, device="cpu", attn_implementation="eager", budget=1.0, batch_size=2)
    got = simple_evaluate(model=kvp, tasks=names, **options)
    hf = HFLM(pretrained=tiny_dir, device="cpu", attn_implementation="eager", batch_size=2)
    expected = simple_evaluate(model=hf, tasks=[n.replace("_qafter", "_qin") for n in names], **options)
    for name in names:
        mine = [s["filtered_resps"] for s in got["samples"][name]]
        assert mine == [s["filtered_resps"] for s in expected["samples"][name.replace("_qafter", "_qin")]]
        assert all(SPLIT_MARKER in s["arguments"][0][0] for s in got["samples"][name])


def test_longbench_metric_functions_exist_and_match_lm_eval():
    module = load_module(TASKS_DIR / "longbench" / "kvp_longbench_metrics.py")
    used = set()
    for path in (TASKS_DIR / "longbench").glob("kvp_longbench_*.yaml"):
        used |= set(re.findall(r"kvp_longbench_metrics\.(\w+)", path.read_text()))
    assert used and all(callable(getattr(module, name)) for name in used)
    for extra in ("jieba", "fuzzywuzzy", "rouge"):
        pytest.importorskip(extra)
    from lm_eval.tasks.longbench import metrics

    doc = {"answers": ["Paragraph 3"], "all_classes": None}
    for name in ("get_retrieval_with_score", "get_rouge_with_score", "get_qa_f1_with_score"):
        assert getattr(module, name)(doc, ["The answer is Paragraph 3"]) == getattr(metrics, name)(
            doc, ["The answer is Paragraph 3"]
        )


def test_longbench_configs_are_up_to_date(tmp_path):
    generator = load_module(TASKS_DIR / "longbench" / "generate_configs.py")
    generator.main(tmp_path)
    committed = {p.name: p.read_text() for p in (TASKS_DIR / "longbench").glob("kvp_longbench_*.yaml")}
    assert committed == {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from kvp_cache.models import MODELS

    return str(MODELS["smollm2"].converted_dir())


def test_ruler_tasks_offline(tokenizer_dir):
    data = load_module(TASKS_DIR / "ruler" / "kvp_ruler_data.py")
    tasks = task_manager(tokenizer=tokenizer_dir, max_seq_lengths=[1024], num_samples=2).load(RULER_TASKS)[
        "tasks"
    ]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name, task in tasks.items():
        kind = name.removeprefix("kvp_ruler_").rsplit("_", 1)[0]
        assert task.config.generation_kwargs["max_gen_toks"] == data.MAX_GEN_TOKS[kind]
        docs = list(task.test_docs())
        assert len(docs) == 2 and {d["max_length"] for d in docs} == {1024}
        samples = ruler.make_samples(kind, tokenizer, 1024 - data.MAX_GEN_TOKS[kind], 2)
        for instance, sample in zip(requests_of(task), samples, strict=True):
            context = instance.args[0]
            prefix, suffix = ruler.chat_prompt(sample, tokenizer, question_in_context=name.endswith("_qin"))
            if name.endswith("_qin"):
                assert context == prefix and suffix == ""
            else:
                assert context == prefix + SPLIT_MARKER + suffix and sample.question in suffix
            assert instance.doc["answers"] == sample.answers
            length = len(tokenizer(prefix + suffix, add_special_tokens=False)["input_ids"])
            assert abs(length - (1024 - data.MAX_GEN_TOKS[kind])) < 0.1 * 1024
        scores = task.process_results(docs[0], [" and ".join(docs[0]["answers"])])
        assert scores["1024"] == 1.0 and scores["4096"] == -1
        assert task.process_results(docs[0], ["nothing"])["1024"] == 0.0
    assert data.aggregate([1.0, -1, 0.0, -1]) == 0.5 and data.aggregate([-1, -1]) == -1


def test_ruler_data_errors(tokenizer_dir):
    data = load_module(TASKS_DIR / "ruler" / "kvp_ruler_data.py")
    with pytest.raises(ValueError, match="tokenizer"):
        data.load("niah_single", True, num_samples=1)
    with pytest.raises(ValueError, match="max_seq_lengths"):
        data.load("niah_single", True, tokenizer=tokenizer_dir, max_seq_lengths=[3000], num_samples=1)


@pytest.mark.slow
def test_ruler_end_to_end_on_smollm2(smollm2, tokenizer_dir, prose_dir):
    """kvp_ruler_niah_single (both protocols) through lm-eval with the kvp model on SmolLM2, 1K tokens."""
    model, tokenizer = smollm2
    metadata = {
        "tokenizer": tokenizer_dir,
        "max_seq_lengths": [1024],
        "num_samples": 2,
        "essays_dir": str(prose_dir),
    }
    manager = task_manager(**metadata)
    names = ["kvp_ruler_niah_single_qin", "kvp_ruler_niah_single_qafter"]
    scores = {}
    for budget in (1.0, 0.25):
        lm = KVPLM(pretrained=model, tokenizer=tokenizer, budget=budget, method="snapkv", batch_size=2)
        out = simple_evaluate(
            model=lm, tasks=names, task_manager=manager, log_samples=True, gen_kwargs={"max_gen_toks": 16}
        )
        for name in names:
            samples = out["samples"][name]
            rescored = [
                ruler.score(ruler.Sample("", "", "", s["doc"]["answers"], ""), s["filtered_resps"][0])
                for s in samples
            ]
            assert out["results"][name]["1024,none"] == pytest.approx(sum(rescored) / len(rescored))
            scores[(name, budget)] = out["results"][name]["1024,none"]
    assert scores[("kvp_ruler_niah_single_qin", 1.0)] >= 0.5  # SmolLM2 finds the needle with the full cache
    assert all(0.0 <= s <= 1.0 for s in scores.values())
