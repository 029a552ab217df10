"""Diagnostic only: the shipped-candidate policy with recency rows clamped to the longest training distance."""
import math
import sys

import kvp_cache.agents as agents

LONGEST = 8070  # the longest training prompt, in tokens
CAP = math.log2(1 + LONGEST) * 127 / agents.RECENCY_SPAN_LOG2
original = agents.HeadAgents.table_positions if hasattr(agents, "HeadAgents") else None
cls = next(c for c in vars(agents).values() if isinstance(c, type) and hasattr(c, "table_positions"))
orig = cls.table_positions
cls.table_positions = lambda self, positions: orig(self, positions).clamp(max=CAP)
print("clamped", cls.__name__, "at row", round(CAP, 2), file=sys.stderr)
from eval.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
