"""Tools around the library: the GPU doctor, the benchmark harness, reporting and plots, the CLI.

The core (callback, capture, prefetch, tune) never imports this package, so that training with
``L2GraphCallback`` loads none of it; ``tests/test_import_graph.py`` checks that.
"""
