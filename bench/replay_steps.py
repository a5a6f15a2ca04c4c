"""Replay a kept bench arm's first training steps with other learner settings, offline.

A ``whet bench learn`` run takes over an hour an arm; whether a learner setting keeps the gate's
pinned turns shows in its first steps. This copies a kept arm's store (``--keep``) as it stood
when its learner had trained through ``--through`` (the samples those steps trained, untrained
again, and the held-out turns judged by then; nothing later), applies ``--set`` overrides to the
arm's config, and runs ``whet learn --once`` on the copy: the same samples, batches and rehearsal
draws (seeded by the version's name), so the steps differ only by what was changed. Then it prints
each replayed step beside the original one: promoted or rejected, the pinned turns the live
version and the candidate answer right, which ones the candidate lost, and the held-out
preference margin.

    python bench/replay_steps.py /tmp/whet-bench-learn-XXXX/lora --through global-0002 \\
        --set learner.lora.learning_rate=5e-4 [--out DIR] [--cores 0]

A replayed step costs what a served one does (SmolLM2, one core: ~4 minutes of start-up, then a
few minutes a step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

_STEPS = """select id, status, json_extract(metrics, '$.gate.regression_actions_kept'),
                  json_extract(metrics, '$.gate.regression_actions_lost_items'),
                  json_extract(metrics, '$.gate.preference_margin')
           from adapters where id <= ? order by id"""


def _known(key: str) -> bool:
    """Whether ``key`` (dotted) is a setting of this checkout's config, though the kept arm's whet.yaml,
    written by an older one, lacks it."""
    from whet.config.settings import WhetConfig

    node: object = WhetConfig()
    for part in key.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def copy_store(arm: Path, out: Path, through: str) -> int:
    """The arm's store in ``out/data`` as its learner had it when step ``through`` was made, with
    those steps' samples untrained; returns how many samples there are to train."""
    source = arm / "data" / "whet.db"
    (out / "data").mkdir(parents=True)
    with sqlite3.connect(source) as src, sqlite3.connect(out / "data" / "whet.db") as db:
        src.backup(db)
        made = db.execute("select created_at from adapters where id = ?", (through,)).fetchone()
        if made is None:
            raise SystemExit(f"error: {through} is not a step of {arm} (see its adapters/ folder)")
        db.execute("delete from judgments where (split = 'train' and (trained_in is null or trained_in > ?))"
                   " or (split != 'train' and created_at > ?)", (through, made[0]))
        db.execute("update judgments set trained_in = null")
        db.execute("delete from turns where id not in (select turn_id from judgments)")
        for table in ("adapters", "lessons"):
            db.execute(f"delete from {table}")  # noqa: S608 - fixed names
        return db.execute("select count(*) from judgments where split = 'train' and trainable").fetchone()[0]


def replay_config(arm: Path, out: Path, overrides: list[str]) -> Path:
    """The arm's config pointed at the copy, with ``overrides``
    (``dotted.key=YAML value``) applied; a key the config does not have is an error."""
    config = yaml.safe_load((arm / "whet.yaml").read_text())
    config["data_dir"] = str(out / "data")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set {item!r}: write it as dotted.key=value")
        *parents, leaf = key.split(".")
        known = _known(key)
        node = config
        for part in parents:
            if known and isinstance(node, dict) and part not in node:
                node[part] = {}  # a section newer than the arm's whet.yaml
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or (leaf not in node and not known):
            raise SystemExit(f"error: --set {key}: the arm's config has no such setting")
        parsed = yaml.safe_load(value)
        if isinstance(node.get(leaf), float) and isinstance(parsed, str):
            parsed = _number(key, parsed)  # YAML 1.1 reads 5e-4 as a string
        node[leaf] = parsed
    path = out / "whet.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"error: --set {key}={value}: the setting is a number") from None


def steps(db_path: Path, through: str) -> list[tuple]:
    with sqlite3.connect(db_path) as db:
        return db.execute(_STEPS, (through,)).fetchall()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", type=Path, help="a kept arm's folder (whet.yaml and data/ inside)")
    parser.add_argument("--through", required=True, help="the last step to replay, e.g. global-0002")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--out", type=Path, help="where the copy goes (default: a new temporary folder)")
    parser.add_argument("--cores", help="pin the learner to these cores (taskset list, e.g. 0)")
    args = parser.parse_args(argv)
    if not (args.arm / "whet.yaml").is_file() or not (args.arm / "data" / "whet.db").is_file():
        parser.error(f"{args.arm} is not a kept arm (run `whet bench learn --keep`; pass its <tmp>/<arm> folder)")
    if args.cores and shutil.which("taskset") is None:
        parser.error("--cores needs taskset (apt-get install util-linux), or leave --cores out")
    out = args.out or Path(tempfile.mkdtemp(prefix="whet-replay-"))
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty")
    samples = copy_store(args.arm, out, args.through)
    config = replay_config(args.arm, out, args.set)
    whet = [sys.executable, "-m", "whet.runtime.cli", "learn", "--once", "--config", str(config)]
    if args.cores:
        whet = ["taskset", "-c", args.cores, *whet]
    print(f"replaying {samples} samples through {args.through} in {out} ({', '.join(args.set) or 'no change'})",
          flush=True)
    with open(out / "learn.log", "wb") as log:
        code = subprocess.run(whet, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        print(f"error: whet learn exited {code}; see {out / 'learn.log'}", file=sys.stderr)
        return code
    print(f"{'step':<12} {'original':<34} {'replayed':<34}")
    replayed = {row[0]: row for row in steps(out / "data" / "whet.db", args.through)}
    for row in steps(args.arm / "data" / "whet.db", args.through):
        again = replayed.get(row[0])
        print(f"{row[0]:<12} {_shown(row):<34} {_shown(again) if again else 'not made':<34}")
    return 0


def _shown(row: tuple) -> str:
    _, status, kept, lost, margin = row
    kept = json.loads(kept) if kept else ["?", "?"]
    lost = json.loads(lost) if lost else []
    return f"{status} {kept[0]}->{kept[1]} lost {lost or '-'} m {margin or 0:+.4f}"


if __name__ == "__main__":
    sys.exit(main())
