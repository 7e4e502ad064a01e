"""The engine owns the device state: every unit is one state step that applies the store's
round work first, and every work was applied once, in order."""

from ninfer_kv.demo import run_demo

from .conftest import demo_config, engine_steps


def test_units_run_as_state_steps_and_apply_every_work():
    config = demo_config()
    steps = engine_steps(config)  # the steps a run of this configuration uses (shared per configuration)
    d = run_demo(config, progress=False).to_json()  # checks the state applied every work once, in order
    assert engine_steps(config) is steps
    # the planes-and-tables steps never ran: each unit dispatched its state step (work applied inside)
    for name in ("ragged", "decode"):  # prompts run in ragged rounds, beside the decodes
        assert steps.steps[name].traces == 0, name
        assert steps.on_state(name).traces >= 1, name
    assert d["units"]["decode"] > 0 and d["compiles"]["decode"] <= len(d["buckets"]["decode"])
