"""Can a cache predict a head's weight in one prompt? SmolLM2, the calibration's training windows.

A head's weight is its evictable future mass: the attention the continuation's queries give the
head's entries outside the sinks and window, per query (the calibration target summed over the
head, ``train.calibrate.measure_window``). The fixed calibration gives each head one weight for every
prompt; this measures how much the weight varies from prompt to prompt within a head, and how much
of that two candidate predictors explain:

- statistics of the policy's own scores (after the calibrated temperature), one slope shared by all
  heads, on deviations from each head's mean;
- the mean attention of the prompt's last W queries to the head's evictable entries
  (``eval.headroom.window_attention``), as ``log weight = a_head + b * log(window mass)`` fitted on the
  calibration's fit windows and checked on its check windows, against the fixed per-head weight
  (``a_head`` alone) and against the window mass itself (``a = 0, b = 1``).

Run from the repository root: ``PYTHONPATH=. python docs/adaptive/oracle_counts/head_weight_predictors.py``
(about 8 minutes on one CPU thread); writes ``head_weight_predictors.json`` next to this file.
"""

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eval.headroom import window_attention
from kvp_cache.models import load_model
from kvp_cache.policy import load_policy
from kvp_cache.prefill import prefill
from kvp_cache.provenance import provenance
from kvp_cache.targets import evictable_only
from train.calibrate import CalibrateConfig, calibration_windows, measure_window, split_windows

WINDOWS = (8, 32, 128)
POLICY = "smollm2-135m-instruct"


def squared_error(log_true: torch.Tensor, log_predicted: torch.Tensor) -> float:
    return (log_true - log_predicted).pow(2).mean().item()


def main() -> None:
    torch.set_num_threads(1)
    config = CalibrateConfig()
    model, tokenizer = load_model(config.model)
    policy = load_policy(POLICY)
    examples = calibration_windows(config, tokenizer)
    scores, mass, window_mass = [], [], {w: [] for w in WINDOWS}
    with torch.no_grad():
        for example in tqdm(examples, desc="windows", unit="window"):
            prefilled = prefill(model, torch.tensor([example.prompt_ids]))
            s, target = measure_window(
                model, policy, example, config.sink_tokens, config.window_tokens, prefilled
            )
            scores.append(s)
            mass.append(target.sum(-1))
            for w in WINDOWS:
                attention = window_attention(model, prefilled, w).values()
                evictable = [evictable_only(a, config.sink_tokens, config.window_tokens) for a in attention]
                window_mass[w].append(torch.stack(evictable).sum(-1))
    scores = torch.stack(scores)
    log_mass = torch.stack(mass).clamp_min(1e-9).log()  # [windows, layers, heads]
    deviation = log_mass - log_mass.mean(0)
    within = deviation.pow(2).mean().item()
    result = {
        "provenance": provenance(config.model, "float32", "cpu", policy, sys.argv),
        "windows": len(examples),
        "log_weight_variance": {"total": log_mass.var().item(), "within_head": within},
        "score_statistics": {},
        "window_attention": {},
    }
    tempered = scores / policy.calibration.temperature[None, ..., None]
    statistics = {
        "logsumexp": tempered.logsumexp(-1),
        "max": tempered.amax(-1),
        "mean": tempered.mean(-1),
        "std": tempered.std(-1),
    }
    for name, value in statistics.items():
        x = value - value.mean(0)
        slope = (x * deviation).sum() / x.pow(2).sum()
        result["score_statistics"][name] = 1 - squared_error(deviation, slope * x) / within
    fit_at, check_at = split_windows(examples, config.check_fraction)
    fit_true, check_true = log_mass[fit_at], log_mass[check_at]
    for w in WINDOWS:
        log_window = torch.stack(window_mass[w]).clamp_min(1e-9).log()
        x, y = log_window[fit_at] - log_window[fit_at].mean(0), fit_true - fit_true.mean(0)
        slope = (x * y).sum() / x.pow(2).sum()
        offset = fit_true.mean(0) - slope * log_window[fit_at].mean(0)
        result["window_attention"][str(w)] = {
            "slope": slope.item(),
            "check_error_fixed_weight": squared_error(check_true, fit_true.mean(0)),
            "check_error_fitted": squared_error(check_true, offset + slope * log_window[check_at]),
            "check_error_window_mass_itself": squared_error(check_true, log_window[check_at]),
        }
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))


if __name__ == "__main__":
    main()
