"""Seed compatibility: comgra and Cockpit code runs by changing only its import lines.

    import deepscope.compat.comgra as comgra
    from deepscope.compat.comgra.recorder import ComgraRecorder
    from deepscope.compat.cockpit import Cockpit, CockpitPlotter
    from deepscope.compat.backpack import extend
"""
