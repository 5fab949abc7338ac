"""The capability vocabulary is the one list that families, detectors, templates and the oracle use."""

from trace_lib.analyst.detectors import DETECTORS
from trace_lib.capabilities import BY_ID, CAPABILITIES, CAPABILITY_TAGS, ORACLE_PRIORITY
from trace_lib.envs.families import FAMILIES
from trace_lib.synth.templates import template_capabilities


def test_every_capability_has_a_detector_a_template_and_a_rank():
    ids = [c.id for c in CAPABILITIES]
    assert len(set(ids)) == len(ids) == 8
    assert list(DETECTORS) == ids == template_capabilities() == list(CAPABILITY_TAGS)
    assert sorted(c.oracle_rank for c in CAPABILITIES) == list(range(len(ids)))
    assert ORACLE_PRIORITY[0] == "adversarial_policy_compliance" and ORACLE_PRIORITY[-1] == "communicate_result"
    for cid, det in DETECTORS.items():
        assert (det.name, det.description, det.recognition) == (BY_ID[cid].name, BY_ID[cid].description,
                                                                 BY_ID[cid].recognition)


def test_family_tags_come_from_the_vocabulary():
    assert set().union(*(f.tags for f in FAMILIES)) <= set(CAPABILITY_TAGS)
