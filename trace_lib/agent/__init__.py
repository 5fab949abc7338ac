"""The episode loop: the agent plays many episodes at once on the engine (`collect_rollouts`)."""
