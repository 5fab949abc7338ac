"""What each training runs with (`training/plan.py`)."""

from __future__ import annotations

from trace_lib.config import TrainConfig


def test_the_student_samples_at_temperature_one_and_trains_every_turn():
    from trace_lib.training.plan import distill_config

    cfg = TrainConfig(temperature=0.8, hint_fraction=0.5, start_late=0.5, learning_rate=5e-4, iterations=7,
                      distill={"iterations": 2, "learning_rate": 1e-4})
    d = distill_config(cfg)
    assert (d.iterations, d.learning_rate, d.temperature, d.hint_fraction, d.start_late, d.filter_lookup_only) == (
        2, 1e-4, 1.0, 0.0, 0.0, False)
    assert distill_config(TrainConfig(learning_rate=5e-4, distill={"iterations": 1})).learning_rate == 5e-4
