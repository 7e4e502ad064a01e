"""The engine owns the device state: every unit is one state step that applies the store's
round work first, and every work was applied once, in order."""

from .conftest import demo_config, engine_steps


def test_units_run_as_state_steps_and_apply_every_work(bf16_run):
    d = bf16_run.to_json()
    steps = engine_steps(demo_config())
    # the planes-and-tables steps never ran: each unit dispatched its state step (work applied inside)
    for name in ("prefill", "decode"):
        assert steps.steps[name].traces == 0, name
        assert steps.on_state(name).traces >= 1, name
    assert d["units"]["decode"] > 0 and d["compiles"]["decode"] <= len(d["buckets"]["decode"])
