"""``python -m train {collect,collect-decode,fit,evaluate,calibrate,downstream,downstream-decode,push,reproduce} --help``."""

from __future__ import annotations

import argparse
import os

import torch


def main(argv: list[str] | None = None) -> None:
    from train import (
        calibrate,
        collect,
        decode,
        decode_downstream,
        downstream,
        evaluate,
        fit,
        push,
        reproduce,
    )

    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module, help_text in [
        ("collect", collect, "run a model over prompts and store K/V + future-attention importance"),
        ("collect-decode", decode, "trace long sequences read under a decode-time cap (decode-time target)"),
        ("fit", fit, "train a KVPolicy on collected traces (RL or a supervised objective)"),
        ("evaluate", evaluate, "eviction-cost curves of a policy and every baseline on held-out traces"),
        ("calibrate", calibrate, "fit a policy's per-head scale so its scores rank entries across heads"),
        ("downstream", downstream, "loss after compression on a collection's held-out samples, per source"),
        ("downstream-decode", decode_downstream, "loss under a decode-time cap on validation sequences"),
        ("push", push, "publish a trained policy directory to the Hugging Face Hub"),
        ("reproduce", reproduce, "collect + fit + evaluate a shipped policy from nothing (--model)"),
    ]:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(func=getattr(module, f"{name.replace('-', '_')}_command"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(getattr(args, "threads", 2) or 2)
    args.func(args)


if __name__ == "__main__":
    main()
