"""Rewards for the actor's RL loop: where scores come from, and the reward functions shipped with aligner.

- `function`: the reward-function interface (`path.py[:name]`; docs/REWARDS.md) and its loader. Imports no torch.
- `pool.RewardPool`: a reward function in worker processes with a per-call timeout; a failure names the function
  and the sample. Imports no torch.
- `math_answer`: a verifiable math reward (final answer from \\boxed{...} or `#### N`, numeric and fraction
  equivalence), usable as `reward.fn: aligner/rewards/math_answer.py`.
- `sources`: the reward sources the trainer picks from once (the critic job with values, the critic job in
  reward-only mode, a reward function run by the actor job) and the optional `TrainedCritic` capability.
Importing this package loads nothing: the worker processes import `function` alone.
"""
