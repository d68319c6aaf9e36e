"""Every YAML file in conf/ (and conf/bench/) loads and validates with the loader of the job it is for, given only
what a user must supply (data files, a tokenizer): a recipe with a misspelt key or a rule it breaks fails here, not
at the start of someone's run."""

import glob
import os

import pytest

from aligner.config.actor import load_actor_config
from aligner.config.critic import load_critic_config
from aligner.config.dpo import load_dpo_config
from aligner.config.reward_model import load_reward_model_config
from aligner.config.sft import load_sft_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONF = os.path.join(REPO, "conf")
TOKENIZER = f"data.tokenizer={CONF}/demo/tokenizer.json"

# (name prefix, loader, what a user supplies) in match order: the critic's names before the actor's "ppo_".
JOBS = (
    ("ppo_step_critic", load_critic_config, []),
    ("ppo_critic", load_critic_config, []),
    ("reward_critic", load_critic_config, []),
    ("ppo_", load_actor_config, [TOKENIZER]),
    ("grpo_", load_actor_config, [TOKENIZER]),
    ("rloo_", load_actor_config, [TOKENIZER]),
    ("sft", load_sft_config, [TOKENIZER, f"data.train_file={CONF}/demo/sft_train.jsonl"]),
    ("dpo", load_dpo_config, [TOKENIZER, f"data.train_file={CONF}/demo/preference_train.jsonl"]),
    ("reward_model", load_reward_model_config, [TOKENIZER, f"data.train_file={CONF}/demo/preference_train.jsonl"]),
)
NAMES = sorted(
    os.path.relpath(p, CONF)[: -len(".yaml")] for p in glob.glob(f"{CONF}/*.yaml") + glob.glob(f"{CONF}/bench/*.yaml")
)


def test_every_recipe_is_covered():
    assert len(NAMES) >= 20, NAMES
    unknown = [n for n in NAMES if not any(os.path.basename(n).startswith(prefix) for prefix, _, _ in JOBS)]
    assert not unknown, f"add the job of {unknown} to JOBS"


@pytest.mark.parametrize("name", NAMES)
def test_recipe_loads_and_validates(name):
    _, load, supplied = next(job for job in JOBS if os.path.basename(name).startswith(job[0]))
    load(["--config-name", name, *supplied])


def test_the_critic_recipe_cuts_micro_batches_no_smaller_than_the_actor_recipe():
    """The same 1B shapes and rows on both sides (docs/PERF.md: small micro-batches leave a GPU host-bound)."""
    actor = load_actor_config(["--config-name", "ppo_actor", TOKENIZER])
    critic = load_critic_config(["--config-name", "ppo_critic"])
    assert critic.train.micro_batch_size >= actor.ppo.micro_batch_size
    assert critic.infer.micro_batch_size >= (actor.ppo.forward_micro_batch_size or actor.ppo.micro_batch_size)
