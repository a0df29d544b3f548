"""The benchmark harness behind ``l2lightning bench``: settings, cases, runners, floors, the run loop.

Importing it needs no torch: the CLI builds its parser from here before torch is loaded.
"""
