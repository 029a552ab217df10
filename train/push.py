"""``python -m train push``: publish a trained policy directory (weights, config, card) to the Hub.

Needs network and a token (``hf auth login`` or ``--token``); the card is regenerated from the
policy's config, including its training record and evaluation table.
"""

from __future__ import annotations

import argparse

from kvp_cache.policy import load_policy


def push_command(args: argparse.Namespace) -> str:
    policy = load_policy(args.policy)
    url = policy.push_to_hub(
        args.repo_id, private=args.private, token=args.token, commit_message=args.message
    )
    print(f"pushed {args.policy} to {url}")
    return url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, help="policy directory or shipped name")
    parser.add_argument("--repo-id", required=True, help="Hub repo 'owner/name' (created if missing)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    parser.add_argument("--message", default="Upload KVP policy", help="commit message")
