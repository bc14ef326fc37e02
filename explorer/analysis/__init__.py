"""The analysis wing: measuring methods on prompt sets. The bench against transformers' baselines (``bench``) and
its reports (``report``), the losslessness audit (``audit``), greedy equivalence checks (``equivalence``), rejection
forensics over many runs (``forensics``) and the prompt sets (``prompts``: MT-bench, HumanEval, JSONL files)."""
