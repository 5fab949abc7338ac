"""Training (paper §3.3): GRPO rollouts with the loss mask, trajectory rewards (the efficiency reward
with its tightening threshold), the rollout ledger that enforces budgets, and the TRL trainer."""
