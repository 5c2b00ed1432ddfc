"""Settings that are valid but inert get a warning when a run starts (QerlConfig.warnings)."""

from __future__ import annotations

from shared.config import load_config


def test_dapo_at_one_mini_batch_warns_that_clip_higher_is_inert():
    """The clip's inertness itself is measured in test_learner (clip_frac 0 at 1, > 0 at 4)."""
    assert any("clip-higher never acts" in w for w in load_config(None, ["learner.algorithm=dapo"]).warnings())
    assert load_config(None, ["learner.algorithm=dapo", "learner.mini_batches=4"]).warnings() == []
    assert load_config(None, []).warnings() == []
