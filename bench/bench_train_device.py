"""Speed of ``train collect`` and ``train fit`` on each device, side by side: the GPU speed-up.

Builds a randomly initialised model with the config and tokenizer of ``--like`` (a model directory;
the cost depends on the shape, not the weights, so the weights need not travel to a GPU machine),
then for each of ``--devices`` runs ``python -m train collect`` on the same essay windows and
``python -m train fit`` on the traces it wrote, in fresh directories, timing both. The CPU runs
see no GPU (``CUDA_VISIBLE_DEVICES=""``), so ``fit`` trains there on the CPU. Prints the times and
the speed-up over the last device, and writes ``--json`` with provenance.

    python bench/bench_train_device.py --like ~/.cache/kvp_cache/SmolLM2-135M-Instruct \
        --essays-dir ESSAYS_DIR --devices cuda cpu --json bench/results/train_device.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvp_cache.provenance import policy_record, provenance, sha256_of
from kvp_cache.tables import markdown_table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, required=True, help="model dir with config.json and tokenizer")
    parser.add_argument("--essays-dir", type=Path, required=True, help="essay .txt dir for the text windows")
    parser.add_argument("--work", type=Path, default=Path("runs/bench_train_device"), help="scratch dir")
    parser.add_argument("--devices", nargs="+", default=["cuda", "cpu"], help="timed in this order")
    parser.add_argument("--windows", type=int, default=16, help="essay windows to trace")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--future-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50, help="fit steps per layer")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="fit only these (default all)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="write the provenance, settings and rows here")
    args = parser.parse_args()
    for name in ("windows", "context_tokens", "future_tokens", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.like / "config.json").is_file():
        parser.error(f"--like {args.like}: no config.json there")
    return args


def random_model(like: Path, out: Path) -> Path:
    """A seeded random model of ``like``'s config, saved with its tokenizer (once)."""
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like))
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(like).save_pretrained(out)
    return out


REPO = Path(__file__).resolve().parents[1]  # where `python -m train` runs


def timed_run(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=REPO)
    return time.perf_counter() - start


def gigabytes(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e9


def main() -> None:
    args = parse_args()
    args.like, args.essays_dir, args.work = (p.resolve() for p in (args.like, args.essays_dir, args.work))
    model_dir = random_model(args.like, args.work / "model")
    train = [sys.executable, "-m", "train"]
    rows = []
    for device in args.devices:
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
        traces, fit = args.work / f"traces-{device}", args.work / f"fit-{device}"
        shutil.rmtree(traces, ignore_errors=True)
        shutil.rmtree(fit, ignore_errors=True)
        collect_s = timed_run(
            [*train, "collect", "--out", str(traces), "--model", str(model_dir), "--device", device,
             "--windows", f"essays={args.windows}", "--essays-dir", str(args.essays_dir),
             "--context-tokens", str(args.context_tokens), "--future-tokens", str(args.future_tokens),
             "--val-fraction", "0.25", "--shard-size", "4", "--threads", str(args.threads)],
            env,
        )  # fmt: skip
        fit_s = timed_run(
            [*train, "fit", "--traces", str(traces), "--out", str(fit), "--objective", "listnet",
             "--steps", str(args.steps), "--warmup", "0", "--eval-every", str(args.steps), "--threads", str(args.threads),
             *(["--layers", *map(str, args.layers)] if args.layers else [])],
            env,
        )  # fmt: skip
        rows.append(
            {
                "device": device,
                "collect_s": collect_s,
                "fit_s": fit_s,
                "traces_gb": gigabytes(traces),
                # The weights this device's fit wrote (only once every layer is trained).
                "policy": policy_record(str(fit / "policy")) if (fit / "policy").is_dir() else None,
            }
        )
        print(
            f"{device}: collect {collect_s:.1f} s, fit {fit_s:.1f} s", flush=True
        )  # kept if a later device times out
    last = rows[-1]
    for row in rows:
        row["collect_speedup"] = last["collect_s"] / row["collect_s"]
        row["fit_speedup"] = last["fit_s"] / row["fit_s"]
    print(
        markdown_table(
            ["device", "collect s", "fit s", f"collect x {last['device']}", f"fit x {last['device']}"],
            [
                [
                    r["device"],
                    f"{r['collect_s']:.1f}",
                    f"{r['fit_s']:.1f}",
                    f"{r['collect_speedup']:.2f}",
                    f"{r['fit_speedup']:.2f}",
                ]
                for r in rows
            ],  # fmt: skip
        )
    )
    if args.json:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        record = {
            "provenance": provenance(str(args.like), torch.float32, gpu or "cpu", command=sys.argv),
            "model_sha256": sha256_of(model_dir / "model.safetensors"),  # the random weights traced
            "settings": {**settings, "gpu": gpu, "cpu_count": os.cpu_count()},
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
