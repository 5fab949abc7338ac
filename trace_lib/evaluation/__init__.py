"""Evaluation (paper §4): the policy runner shared by the evaluate, scaling and GEPA steps, the inputs
it finds (adapters, budgets, kept capabilities), Table 1-shaped tables, the scaling curve and the
GEPA baseline."""
