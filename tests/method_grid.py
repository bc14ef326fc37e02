"""The method grid the device and KV-cache tests run: every method, every verifier, every stop policy, lossy and
lossless, greedy and sampled, on the tiny pair."""

from explorer.config import DEFAULTS, MethodConfig

PROMPT = "def f(x):\n    return"

# (config, temperature): every method, every verifier, every stop policy, lossy and lossless, greedy and sampled.
GRID = [
    (DEFAULTS["ar"], 0.0),
    (DEFAULTS["ar"], 0.8),
    (MethodConfig(method="sd", gamma=3), 0.0),
    (MethodConfig(method="sd", gamma=3), 0.8),
    (MethodConfig(method="mcsd", k_config=(2, 2)), 0.0),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs"), 0.8),
    (MethodConfig(method="mcsd", k_config=(3, 1), verifier="rrs-replacement"), 0.8),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="mcns"), 0.8),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="spechub"), 0.8),
    (MethodConfig(method="mcsd", k_config=(2, 2), branch_threshold=0.5), 0.8),
    (DEFAULTS["mcsd-improved"], 0.0),
    (DEFAULTS["mcsd-improved"], 0.8),
    (MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=4, stop="none"), 0.8),
    (MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=4, stop="confidence"), 0.8),
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="prune"), 0.8),
    (MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=4, stop="specdec++"), 0.8),
    (MethodConfig(method="mcsd-improved", max_depth=4, stop="decision", decision_model="path"), 0.8),
    (MethodConfig(method="mcsd-improved", max_depth=4, stop="decision", decision_model="hidden"), 0.0),
    (MethodConfig(method="mcsd-improved", lossy=True, width=3, k_config=(1,), max_depth=3), 0.0),
    (MethodConfig(method="mcsd-improved", lossy=True, width=2, k_config=(2,), max_depth=3, stop="decision"), 0.8),
]


def _case_id(c: MethodConfig, t: float) -> str:
    parts = [c.method] + ([c.verifier] if c.verifier != "auto" else [])
    if c.method == "mcsd-improved":
        parts += [c.stop] + ([c.decision_model] if c.stop in ("decision", "prune", "specdec++") else [])
        parts += ["lossy"] if c.is_lossy else []
    if c.branch_threshold < 1.0:
        parts.append(f"adaptive{c.branch_threshold}")
    return "-".join(parts) + f"-T{t}"


IDS = [_case_id(c, t) for c, t in GRID]
