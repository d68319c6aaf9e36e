"""The supervised trainers: SFT (sft.py), reward model (reward_model.py), DPO (dpo.py), on one shared loop (loop.py:
batches -> step -> log -> validate -> checkpoint -> stop) and shared task helpers (common.py). Entry scripts:
scripts/train_sft.py, scripts/train_reward_model.py, scripts/train_dpo.py (through cli.py). docs/TRAINERS.md."""
