"""Rejected by `static`: a syntax error."""

CAPABILITY = "communicate_result"


def generate_task(seed, difficulty=1)
    return {}
