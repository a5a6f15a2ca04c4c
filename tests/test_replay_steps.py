"""bench/replay_steps.py: the store copy holds what the learner had at the named step, untrained; overrides
name real settings (the replay itself is `whet learn --once`, tested with the learner)."""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "replay_steps.py"


@pytest.fixture
def replay(monkeypatch):
    spec = importlib.util.spec_from_file_location("replay_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "replay_steps", module)
    spec.loader.exec_module(module)
    return module


def kept_arm(folder: Path) -> Path:
    """An arm as `whet bench learn --keep` leaves it: two steps made, judgments before, between and after."""
    (folder / "data").mkdir(parents=True)
    (folder / "whet.yaml").write_text(yaml.safe_dump({"data_dir": "elsewhere", "learner": {
        "batch_timeout_s": 1, "lora": {"learning_rate": 0.001, "epochs": 4}}}))
    with sqlite3.connect(folder / "data" / "whet.db") as db:
        db.executescript("""
            create table turns (id text primary key);
            create table judgments (turn_id text, split text, trainable int, trained_in text, created_at text);
            create table adapters (id text, status text, metrics text, created_at text);
            create table lessons (id text);
            insert into lessons values ('l1');
            insert into adapters values ('global-0001', 'rejected', '{"gate": {"regression_actions_kept": [24, 22],
                "regression_actions_lost_items": [2, 13], "preference_margin": 0.004}}', '2026-01-01 00:10');
            insert into adapters values ('global-0002', 'live', '{}', '2026-01-01 00:20');
            insert into adapters values ('global-0003', 'rejected', '{}', '2026-01-01 00:30');
        """)
        rows = [("t1", "train", 1, "global-0001", "00:01"), ("t2", "train", 1, "global-0002", "00:11"),
                ("t3", "holdout", 1, None, "00:12"), ("t4", "train", 1, "global-0003", "00:21"),
                ("t5", "holdout", 1, None, "00:25"), ("t6", "train", 1, None, "00:26"),
                ("t7", "train", 0, None, "00:05")]  # fmt: skip
        for turn, split, trainable, trained_in, at in rows:
            db.execute("insert into turns values (?)", (turn,))
            db.execute("insert into judgments values (?, ?, ?, ?, ?)",
                       (turn, split, trainable, trained_in, f"2026-01-01 {at}"))
    return folder


def test_the_copy_holds_the_steps_samples_untrained_and_nothing_judged_later(replay, tmp_path):
    arm = kept_arm(tmp_path / "lora")
    assert replay.copy_store(arm, tmp_path / "out", "global-0002") == 2  # t1 and t2, to train again
    with sqlite3.connect(tmp_path / "out" / "data" / "whet.db") as db:
        kept = dict(db.execute("select turn_id, trained_in from judgments").fetchall())
        assert kept == {"t1": None, "t2": None, "t3": None}  # the held-out turn judged by then; not t4-t6
        assert [r[0] for r in db.execute("select id from turns order by id")] == ["t1", "t2", "t3"]
        assert db.execute("select count(*) from adapters").fetchone()[0] == 0
        assert db.execute("select count(*) from lessons").fetchone()[0] == 0
    with sqlite3.connect(arm / "data" / "whet.db") as db:  # the arm itself is untouched
        assert db.execute("select count(*) from judgments where trained_in is not null").fetchone()[0] == 3
    with pytest.raises(SystemExit, match="global-0009 is not a step"):
        replay.copy_store(arm, tmp_path / "again", "global-0009")


def test_overrides_apply_to_the_arms_config_and_an_unknown_setting_is_named(replay, tmp_path):
    arm = kept_arm(tmp_path / "lora")
    (tmp_path / "out").mkdir()
    path = replay.replay_config(arm, tmp_path / "out", ["learner.lora.learning_rate=5e-4", "learner.lora.epochs=2"])
    config = yaml.safe_load(path.read_text())
    assert config["data_dir"] == str(tmp_path / "out" / "data")
    assert config["learner"]["lora"] == {"learning_rate": 5e-4, "epochs": 2}
    # a setting this checkout has and the arm's (older) whet.yaml lacks is added; one nobody has is named
    path = replay.replay_config(arm, tmp_path / "out", ["learner.rehearsal.first_token_weight=1.5"])
    assert yaml.safe_load(path.read_text())["learner"]["rehearsal"] == {"first_token_weight": 1.5}
    with pytest.raises(SystemExit, match="learner.lora.ranks: the arm's config has no such setting"):
        replay.replay_config(arm, tmp_path / "out", ["learner.lora.ranks=4"])
    with pytest.raises(SystemExit, match="dotted.key=value"):
        replay.replay_config(arm, tmp_path / "out", ["learner.lora.epochs"])


def test_the_step_table_shows_the_gates_verdict(replay, tmp_path):
    arm = kept_arm(tmp_path / "lora")
    rows = replay.steps(arm / "data" / "whet.db", "global-0002")
    assert [r[0] for r in rows] == ["global-0001", "global-0002"]
    assert replay._shown(rows[0]) == "rejected 24->22 lost [2, 13] m +0.0040"
    assert replay._shown(rows[1]) == "live ?->? lost - m +0.0000"
