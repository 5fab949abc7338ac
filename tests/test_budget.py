"""Rollout-budget ledger: counts per stage and key, remaining budget, crash-tolerant appends, sums."""

import pytest

from trace_lib.budget import RolloutLedger, total_rollouts


def test_add_used_remaining(tmp_path):
    led = RolloutLedger(tmp_path / "train" / "a" / "rollouts.jsonl")
    assert led.used() == 0 and led.rows() == []
    led.add("train", 8, key="a")
    led.add("train", 8, key="a")
    led.add("synthesize", 4, key="a")
    led.add("train", 3, key="b")
    assert led.used() == 23
    assert led.used("train") == 19
    assert led.used("train", "a") == 16
    assert led.used(key="a") == 20
    assert led.remaining(20, "train", "a") == 4
    assert led.remaining(10, "train", "a") == 0
    assert led.rows()[0] == {"stage": "train", "key": "a", "rollouts": 8}
    with pytest.raises(ValueError):
        led.add("train", -1)


def test_partial_last_line_is_ignored_then_repaired(tmp_path):
    led = RolloutLedger(tmp_path / "r.jsonl")
    led.add("train", 8, key="a")
    with led.path.open("ab") as fh:  # a crash in the middle of an append
        fh.write(b'{"stage": "train", "key": "a", "roll')
    with pytest.warns(UserWarning, match="partial last line"):
        assert led.used() == 8
    assert led.truncated_tail
    with pytest.warns(UserWarning, match="partial last line"):
        led.add("train", 2, key="a")
    assert led.used() == 10 and not led.truncated_tail
    assert led.path.read_text().count("\n") == 2


def test_a_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    row = '{"stage": "train", "key": "", "rollouts": 1}\n'
    path.write_text(row + "not json\n" + row)
    with pytest.raises(ValueError, match="r.jsonl:2"):
        RolloutLedger(path).used()


def test_reset_replaces_one_keys_rows_with_a_checkpoints(tmp_path):
    led = RolloutLedger(tmp_path / "r.jsonl")
    for n in (4, 4, 4):
        led.add("train", n, key="a")
    led.add("train", 5, key="b")
    saved = [{"stage": "train", "key": "a", "rollouts": 4}]
    assert led.reset("train", "a", saved) == 8  # rows logged after the checkpoint are dropped
    assert led.used("train", "a") == 4 and led.used("train", "b") == 5
    led.path.unlink()  # DVC removed the file with the stage's other outputs
    assert led.reset("train", "a", saved * 2) == -8 and led.rows() == saved * 2
    with led.path.open("a") as fh:
        fh.write('{"stage": "tr')  # a crash mid-append
    with pytest.warns(UserWarning, match="partial last line"):
        assert led.reset("train", "a", saved * 2) == 0
    assert led.path.read_text().endswith("}\n") and led.used() == 8
    with pytest.raises(ValueError, match="must all be"):
        led.reset("train", "a", [{"stage": "train", "key": "b", "rollouts": 1}])


def test_total_rollouts_sums_several_ledgers(tmp_path):
    a, b = RolloutLedger(tmp_path / "a.jsonl"), RolloutLedger(tmp_path / "b.jsonl")
    a.add("train", 8, key="cap1")
    b.add("train", 8, key="cap2")
    b.add("baseline", 16)
    tot = total_rollouts([a.path, b.path])
    assert tot["total"] == 32
    assert tot["by_stage"] == {"baseline": 16, "train": 16}
    assert tot["by_key"] == {"baseline": 16, "train/cap1": 8, "train/cap2": 8}
    with pytest.raises(FileNotFoundError):
        total_rollouts([tmp_path / "missing.jsonl"])
    assert total_rollouts([tmp_path / "missing.jsonl", a.path], missing_ok=True)["total"] == 8
