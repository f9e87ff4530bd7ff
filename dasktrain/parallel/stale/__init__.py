"""Double buffering's stale steps: while a step's sum travels, each
replica applies the previous step's; which recipe applies and its calls at
each point of a step (``recipes``), the corrected step (``correction``)
and weight prediction (``prediction``).
"""
