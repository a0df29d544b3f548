"""The training application: the Hydra entry point (``train``) and the model families (``models``).

It sits on top of the core like any user's code would; the core never imports it.
"""
