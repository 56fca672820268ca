"""rlgate: reinforcement learning for any OpenAI-compatible agent. The `rlgate` command lives in `cli`."""
