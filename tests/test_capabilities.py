"""The capability vocabulary is the one list that families, detectors, templates and the oracle use."""

from trace_lib.analyst.detectors import DETECTORS
from trace_lib.capabilities import BY_ID, CAPABILITIES, CAPABILITY_TAGS, ORACLE_PRIORITY
from trace_lib.config import EnvConfig
from trace_lib.envs import make_tasks
from trace_lib.envs.retail.families import FAMILIES
from trace_lib.synth.templates import template_capabilities


PHONE_ONLY = ["state_dependency_resolution", "missing_information_handling", "argument_canonicalization"]


def test_every_capability_has_a_detector_a_template_and_a_rank():
    ids = [c.id for c in CAPABILITIES]
    assert len(set(ids)) == len(ids) == 11
    assert list(DETECTORS) == ids == list(CAPABILITY_TAGS)
    retail = [i for i in ids if i not in PHONE_ONLY]
    assert template_capabilities() == template_capabilities("tau2-retail") == retail
    assert template_capabilities("phone") == ["tool_call_precision", "communicate_result", "multi_step_completion",
                                              *PHONE_ONLY]
    assert sorted(c.oracle_rank for c in CAPABILITIES) == list(range(len(ids)))
    assert list(ORACLE_PRIORITY[:3]) == PHONE_ONLY  # the phone's specific skills before the shared ones
    assert ORACLE_PRIORITY[3] == "adversarial_policy_compliance" and ORACLE_PRIORITY[-1] == "communicate_result"
    for cid, det in DETECTORS.items():
        assert (det.name, det.description, det.recognition) == (BY_ID[cid].name, BY_ID[cid].description,
                                                                 BY_ID[cid].recognition)


def test_family_tags_come_from_the_vocabulary():
    assert set().union(*(f.tags for f in FAMILIES)) <= set(CAPABILITY_TAGS)
    phone = make_tasks(EnvConfig(name="phone", tasks_per_family=4), "all")
    assert {tag for t in phone for tag in t.capability_tags} == set(template_capabilities("phone"))
