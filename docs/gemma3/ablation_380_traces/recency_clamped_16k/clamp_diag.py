"""Diagnostic only, not a code path of the package: run ``python -m eval`` with every ``recency``
policy's table rows clamped to the row of the longest training prompt's distance (8,070 tokens).

Usage: ``python clamp_diag.py benchmark --model gemma3-270m --policy <dir> ...`` (the eval CLI's args).
"""

import math
import sys

from kvp_cache.agents import RECENCY_SPAN_LOG2, HeadAgents

LONGEST = 8070  # tokens of the longest training prompt
CAP = math.log2(1 + LONGEST) * 127 / RECENCY_SPAN_LOG2  # 128-row table
unclamped = HeadAgents.table_positions
HeadAgents.table_positions = lambda self, positions: unclamped(self, positions).clamp(max=CAP)

from eval.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
