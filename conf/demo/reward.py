"""The CPU demo's reward function: the fraction of response characters that are the label's letter ("a").

A random-initialised policy emits that character about 1 time in 50; PPO makes it frequent within a few dozen steps,
so a rising `rollout/reward_mean` is easy to see. Contract (aligner.critic reward functions):
reward_fn(prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float].
"""


def reward_fn(prompts, responses, labels=None):
    labels = labels or [None] * len(responses)
    scores = []
    for response, label in zip(responses, labels):
        target = label or "a"
        scores.append(sum(ch == target for ch in response) / max(1, len(response)) if response else 0.0)
    return scores
