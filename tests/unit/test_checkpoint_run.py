"""aligner.checkpoint.run: the run's commit record (which steps both jobs completed)."""

import pytest


def test_run_commit_record_keeps_the_newest_steps_and_names_damage(tmp_path):
    from aligner.checkpoint import dist_ckpt, run

    record = run.Commit("a1").add(2, keep=2).add(4, keep=2).add(6, keep=2)
    assert record.steps == [4, 6]
    run.write(str(tmp_path), record)
    assert run.read(str(tmp_path)) == record
    (tmp_path / run.RECORD).write_text("{not json")
    with pytest.raises(dist_ckpt.CheckpointError, match="committed.json is unreadable"):
        run.read(str(tmp_path))
