"""kvp-cache: learned KV-cache eviction (KVP) and baselines as a drop-in transformers Cache."""

from kvp_cache.compat import check_transformers_version

check_transformers_version()

from kvp_cache.budget import validate_budget  # noqa: E402
from kvp_cache.cache import KVPCache  # noqa: E402
from kvp_cache.models import load_model  # noqa: E402
from kvp_cache.policy import KVPolicy, load_policy, shipped_policies  # noqa: E402
from kvp_cache.scorers import Scorer, available_methods, make_scorer, methods, register_scorer  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "KVPCache",
    "KVPolicy",
    "Scorer",
    "available_methods",
    "load_model",
    "load_policy",
    "make_scorer",
    "methods",
    "register_scorer",
    "shipped_policies",
    "validate_budget",
]
