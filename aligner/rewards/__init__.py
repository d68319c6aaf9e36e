"""Reward functions: their interface and loader, a worker pool to run them, and the ones shipped with aligner. Used
by the actor's reward sources (aligner.ppo.reward_sources) and by the critic job's reward function.

- `function`: the reward-function interface (`path.py[:name]`; docs/REWARDS.md) and its loader. Imports no torch.
- `pool.RewardPool`: a reward function in worker processes with a per-call timeout; a failure names the function
  and the sample. Imports no torch.
- `math_answer`: a verifiable math reward (final answer from \\boxed{...} or `#### N`, numeric and fraction
  equivalence), usable as `reward.fn: aligner/rewards/math_answer.py`.
Importing this package loads nothing: the worker processes import `function` alone.
"""
